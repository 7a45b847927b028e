"""A compiled step's device time by source line: the step profiled over a few calls
(`jax.profiler.trace`), the trace's device events summed per HLO instruction, and each
instruction labelled with the source line its metadata names (``file.py:line``; the
instruction's name where it has none). On a GPU the events are those of the ``XLA Ops`` line
(each HLO instruction's kernels); on a CPU, the thunks the runtime records.
"""

from __future__ import annotations

import collections
import pathlib
import re
import tempfile

import jax
from jax.profiler import ProfileData

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}", re.M)
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')  # (older XLA)
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_OP = re.compile(r'op_name="([^"]*)"')


def _table(text: str, section: str) -> dict[str, str]:
    """The numbered entries of one of the module's tables (``FileNames``, ``StackFrames``...)."""
    found = re.search(rf"^{section}\n((?:\d+ .*\n)*)", text, re.M)
    rows = found[1].splitlines() if found else []
    return dict(row.split(" ", 1) for row in rows)


def labels(hlo_text: str) -> dict[str, str]:
    """``{instruction name: "file.py:line primitive"}`` from a compiled module's text (its
    metadata's source line, or its stack frame's innermost location)."""
    files, frames = _table(hlo_text, "FileNames"), _table(hlo_text, "StackFrames")
    locations = _table(hlo_text, "FileLocations")
    out = {}
    for name, metadata in _INSTRUCTION.findall(hlo_text):
        op = _OP.search(metadata)
        primitive = op[1].rsplit("/", 1)[-1] if op else ""
        source, frame = _SOURCE.search(metadata), _FRAME.search(metadata)
        if source:
            where = f"{pathlib.Path(source[1]).name}:{source[2]}"
        elif frame and frame[1] in frames:
            location = locations[re.search(r"file_location_id=(\d+)", frames[frame[1]])[1]]
            file = files[re.search(r"file_name_id=(\d+)", location)[1]].strip('"')
            line = re.search(r" line=(\d+)", location)[1]
            where = f"{pathlib.Path(file).name}:{line}"
        else:
            continue
        out[name] = f"{where} {primitive}".strip()
    return out


def _events(data: ProfileData):
    """``(instruction name, seconds)`` of every device event that names its instruction."""
    for plane in data.planes:
        if not (plane.name.startswith("/device:") or plane.name == "/host:CPU"):
            continue
        lines = list(plane.lines)
        ops = [line for line in lines if line.name == "XLA Ops"]
        for line in ops or lines:
            for event in line.events:
                stats = dict(event.stats)
                name = event.name if ops else stats.get("hlo_op")
                if name:
                    yield str(name), event.duration_ns * 1e-9


def by_line(compiled, args, calls: int) -> dict[str, float]:
    """``{source line: device seconds per call}`` of `compiled` called on `args` (after one
    call outside the trace)."""
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(calls):
                jax.block_until_ready(compiled(*args))
        paths = list(pathlib.Path(folder).rglob("*.xplane.pb"))
        if len(paths) != 1:
            raise RuntimeError(f"the trace wrote {len(paths)} profiles, not one: {paths}")
        data = ProfileData.from_file(str(paths[0]))
    names = labels(compiled.as_text())
    totals: dict[str, float] = collections.defaultdict(float)
    for name, seconds in _events(data):
        totals[names.get(name, name)] += seconds / calls
    if not totals:
        raise RuntimeError("the profile holds no device event naming an HLO instruction")
    return dict(totals)
