"""Starting the multi-device worker subprocesses, shared by `conftest.py` (which starts the
8-device workers as soon as the tests are collected, so that they run on the second core while
the in-process tests run on the first; under pytest-xdist the fixture that reads a worker's
result starts it) and the tests that read their results
(`test_multidevice.py`; `test_ghost.py` for `ghost_multidevice.py`)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

WORKERS = pathlib.Path(__file__).resolve().parent
TIMEOUT_S = 300  # per subprocess; the whole 8-device worker takes about 100 s of one core
GHOST_TIMEOUT_S = 900  # ghost_multidevice.py takes about 8 minutes of one core

# The 8-device worker's sections (`multidevice.py` runs the ones it is given, in this order),
# each with the groups of checks it records (a check's name is ``group/what``).
SECTIONS: dict[str, tuple[str, ...]] = {
    "jit-explicit": ("jit-explicit", "hlo"),
    "shard_map": (
        "hlo",
        "shard_map-str",
        "shard_map-specs",
        "shard_map-ord",
        "shard_map-optax-differs",
        "shard_map-vjp",
    ),
    "shard_map-spellings": (
        "shard_map-tuple",
        "shard_map-specs-auto",
        "shard_map-names",
        "shard_map-prefix",
        "shard_map-list",
        "shard_map-none",
        "shard_map-no-check-vma",
    ),
    "shard_map-lowp": ("shard_map-lowp", "shard_map-lowp-f16"),
    "shard_map-overflow": (
        "shard_map-overflow-big",
        "shard_map-overflow-tiny",
        "shard_map-overflow-ord",
        "shard_map-overflow-inf",
    ),
    "shard_map-nan-underflow": ("shard_map-nan-underflow",),
    "pmap": ("pmap",),
    "axis-checks": ("axis-checks",),
    "split-check": ("split-check",),
    "jit-auto": ("jit-auto", "hlo"),
    "adaptive": ("adaptive",),
    "guarded": ("guarded",),
    "auto": ("auto",),
    "groups": ("groups", "hlo"),
    "layers": ("layers",),
    "devices": ("devices",),
}
# The sections only the slow tier runs: the fast tier keeps the norm and the clip under jit,
# shard_map (an axis name, and shard_map's own in_specs) and pmap at every magnitude, and every
# check of an axis name; these add the other ways to name the axes in shard_map, the automatic
# mesh, the adaptive clips, the guards, group and per-layer norms and scattered leaves (about
# four fifths of the worker's time).
SLOW_SECTIONS = frozenset(
    {
        "shard_map-spellings",
        "jit-auto",
        "adaptive",
        "guarded",
        "auto",
        "groups",
        "layers",
        "devices",
    }
)


def multidevice_sections(items) -> list[str]:
    """The sections the selected test items need: each selected
    ``test_multidevice_section_passes[section]`` case its own, and every fast section when a
    selected test reads the worker's results otherwise."""
    needed: set[str] = set()
    for item in items:
        if "multidevice" not in getattr(item, "fixturenames", ()):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "section" in callspec.params:
            needed.add(callspec.params["section"])
        else:
            needed.update(name for name in SECTIONS if name not in SLOW_SECTIONS)
    return [name for name in SECTIONS if name in needed]


def env_for(devices: int) -> dict:
    """This environment with JAX on `devices` CPU devices."""
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    # jax.distributed's coordinator speaks gRPC, which would honour a proxy even for 127.0.0.1.
    for name in ("no_proxy", "NO_PROXY"):
        env[name] = ",".join(filter(None, [env.get(name), "127.0.0.1", "localhost"]))
    return env


def result(stdout: str):
    """The JSON a worker printed after ``RESULT``, or None."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


_started: dict = {}


def start_multidevice(sections: list[str]) -> subprocess.Popen:
    """The 8-device worker running `sections`, started once per test session."""
    if "multidevice" not in _started:
        _started["multidevice"] = subprocess.Popen(
            [sys.executable, str(WORKERS / "multidevice.py"), *sections],
            env=env_for(8),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    return _started["multidevice"]


def start_ghost_multidevice() -> subprocess.Popen:
    """`ghost_multidevice.py` (the ghost engine on 8 CPU devices, slow tier), started once per
    test session. It sets its own device count; ``PYTHONPATH`` makes it import the optclip under
    test (a checkout's or an installed wheel's)."""
    if "ghost_multidevice" not in _started:
        import optclip

        package_root = pathlib.Path(optclip.__file__).resolve().parent.parent
        _started["ghost_multidevice"] = subprocess.Popen(
            [sys.executable, str(WORKERS.parent / "ghost_multidevice.py")],
            env=dict(os.environ, PYTHONPATH=str(package_root)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    return _started["ghost_multidevice"]


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Waits for a worker (bounded: past `timeout` every worker is killed and the wait raises)
    and returns what it printed."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_all()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def stop_all() -> None:
    """Kills and reaps any worker still running (the session is over)."""
    for proc in _started.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    _started.clear()
