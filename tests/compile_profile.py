"""A pytest plugin that counts XLA compiles and their seconds per test.

    PYTHONPATH=tests python -m pytest -q -n 2 -p compile_profile

writes ``compiles-<process>.json`` (``{test id: [compiles, seconds, small compiles, their
seconds]}``, a compile being small under 0.15 s, the size of one eager operation's program) to
the directory in ``OPTCLIP_COMPILE_PROFILE`` (default: the current one), one file per pytest
process, and prints each process's totals. It wraps `jax._src.compiler.backend_compile_and_load`
(private: the one call every compile of the jit, eager and AOT paths goes through) from
`pytest_configure`, so importing this module changes nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest

SMALL_S = 0.15
_current: list[str | None] = [None]
_counts: dict[str, list[float]] = {}


def pytest_configure(config):
    from jax._src import compiler

    original = compiler.backend_compile_and_load

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            row = _counts.setdefault(_current[0] or "<outside a test>", [0, 0.0, 0, 0.0])
            row[0] += 1
            row[1] += seconds
            if seconds < SMALL_S:
                row[2] += 1
                row[3] += seconds

    compiler.backend_compile_and_load = timed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield
    _current[0] = None


def pytest_sessionfinish(session):
    if not _counts:
        return
    process = os.environ.get("PYTEST_XDIST_WORKER", "main")
    out = pathlib.Path(os.environ.get("OPTCLIP_COMPILE_PROFILE", ".")) / f"compiles-{process}.json"
    out.write_text(json.dumps(_counts, indent=1))
    compiles, seconds, small, small_s = (sum(row[i] for row in _counts.values()) for i in range(4))
    print(
        f"\n{process}: {compiles:.0f} compiles, {seconds:.0f} s; {small:.0f} of them under "
        f"{SMALL_S} s, {small_s:.0f} s; {out}"
    )
