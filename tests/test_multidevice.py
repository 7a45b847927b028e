"""Multi-device and multi-process clipping.

JAX fixes its device count when it starts, and the other tests expect the default single CPU
device, so the checks run in subprocesses (``tests/_workers/``), each starting JAX once and
running many checks; every check compares a result with the float64 NumPy reference of the same
global data at rtol 1e-5 (float16/bfloat16 outputs at their rounding), or an error's text:

* ``multidevice.py``, 8 CPU devices (started by ``conftest.py`` when the tests are collected;
  the fast tier runs its sections but ``launch.SLOW_SECTIONS``): jit over ``NamedSharding``
  arrays on explicit and automatic meshes (and the compiled HLO: small all-reduces, no all-gather);
  ``axis_name`` inside ``shard_map`` and ``pmap`` in every accepted form, checked
  (unbound axes, replicated leaves declared split, undeclared axes) and inferred
  (``None``/``"auto"``); group norms; ``guarded``'s loss scale, skipped steps and spike test
  (the same on every device); float16/bfloat16, overflow and underflow, ``ord``; per-layer norms
  of stacked leaves whose layer axis is sharded under jit, split inside ``shard_map`` and
  ``pmap``, or not split; eager leaves on different devices; and optax's own clip inside
  ``shard_map`` using each device's local norm.
* ``distributed.py``, 2 processes x 2 CPU devices joined by ``jax.distributed`` over 127.0.0.1
  (gloo collectives; slow tier): a sharded gradient tree clipped inside a jitted
  ``optax.chain(global_clip(...), optimizer)`` step and inside ``shard_map``, and per-leaf
  norms, every process checked.
"""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys
import time

import pytest
from _workers import launch

WORKERS = launch.WORKERS
TIMEOUT_S = launch.TIMEOUT_S


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failures(results: dict, prefix: str = "") -> dict:
    return {name: r for name, r in results.items() if name.startswith(prefix) and not r["ok"]}


@pytest.fixture(scope="module")
def multidevice(request):
    """Results of the checks the selected tests need, from one 8-device process (started by
    conftest.py as soon as the tests were collected, so it has mostly run by now)."""
    sections = launch.multidevice_sections(request.session.items)
    done = launch.finish(launch.start_multidevice(sections), launch.TIMEOUT_S)
    results = launch.result(done.stdout)
    assert done.returncode == 0 and results is not None, done.stderr[-5000:]
    return results


def _run_distributed(num_processes: int, tmp_path: pathlib.Path):
    """Starts the processes, waits for all of them (bounded), and always reaps them."""
    port = _free_port()
    procs, logs = [], []
    try:
        for rank in range(num_processes):
            out = open(tmp_path / f"p{rank}.out", "w+")
            err = open(tmp_path / f"p{rank}.err", "w+")
            logs.append((out, err))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKERS / "distributed.py"),
                        str(rank),
                        str(num_processes),
                        str(port),
                    ],
                    env=launch.env_for(2),
                    stdout=out,
                    stderr=err,
                    text=True,
                )
            )
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    outputs = []
    for proc, (out, err) in zip(procs, logs):
        out.seek(0)
        err.seek(0)
        outputs.append((proc.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return outputs


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """Each process's results, from 2 processes x 2 CPU devices joined by jax.distributed."""
    for attempt in range(2):  # a second try only if the free port was taken meanwhile
        outputs = _run_distributed(2, tmp_path_factory.mktemp(f"distributed{attempt}"))
        results = [launch.result(stdout) for _, stdout, _ in outputs]
        if all(r is not None for r in results):
            break
    report = "\n\n".join(
        f"process {i}: rc {rc}\n{err[-3000:]}" for i, (rc, _, err) in enumerate(outputs)
    )
    assert all(rc == 0 for rc, _, _ in outputs), report
    assert all(r is not None for r in results), report
    return results


def test_multidevice_checks_all_ran(multidevice):
    errors = {name: r["error"] for name, r in multidevice.items() if name.endswith("/error")}
    assert not errors, "\n".join(f"{name}:\n{error}" for name, error in errors.items())
    known = {group for groups in launch.SECTIONS.values() for group in groups}
    assert {name.split("/")[0] for name in multidevice} <= known


@pytest.mark.every_case  # one worker run checks every section at once
@pytest.mark.parametrize(
    "section",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in launch.SLOW_SECTIONS else name
        for name in launch.SECTIONS
    ],
)
def test_multidevice_section_passes(multidevice, section):
    """Each of the section's groups of checks ran and equals its float64 reference."""
    assert f"{section}/error" not in multidevice, multidevice[f"{section}/error"]["error"]
    for group in launch.SECTIONS[section]:
        checks = [name for name in multidevice if name.split("/")[0] == group]
        assert checks, f"no check of group {group} ran"
        assert not _failures(multidevice, group + "/")


def test_hlo_all_reduces_scalars_and_gathers_nothing(multidevice):
    hlo = {name: r for name, r in multidevice.items() if name.startswith("hlo/")}
    fast = {f"hlo/explicit/{f}" for f in ("global_norm", "clip_by_global_norm", "global_clip_step")}
    assert fast | {"hlo/shard_map/clip_by_global_norm"} <= set(hlo), hlo
    assert all(r["ok"] for r in hlo.values()), hlo


def test_optax_clips_each_device_by_its_local_norm_and_optclip_does_not(multidevice):
    assert multidevice["shard_map-optax-differs/optax_is_wrong"]["ok"]
    assert multidevice["shard_map-optax-differs/per_device_norms_differ"]["ok"]
    assert multidevice["shard_map-optax-differs/optclip_is_right"]["ok"]


@pytest.mark.slow
def test_jax_distributed_two_processes(distributed):
    for rank, out in enumerate(distributed):
        failures = _failures(out["results"])
        assert not failures, f"process {rank}: {failures}"
        assert len(out["results"]) >= 10 and out["values"]
        for model in ("transformer/Auto", "mlp/Explicit"):  # (ghost clipping's checks ran)
            assert f"distributed/clipped_grad/{model}/sums" in out["results"], out["results"]
    # Every process sees the same global norm, bit for bit.
    assert distributed[0]["values"] == distributed[1]["values"]
