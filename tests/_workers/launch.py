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
TIMEOUT_S = 300  # per subprocess; the 8-device worker takes about 100 s of one core
GHOST_TIMEOUT_S = 900  # ghost_multidevice.py takes about 8 minutes of one core


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


def start_multidevice() -> subprocess.Popen:
    """The 8-device worker, started once per test session."""
    if "multidevice" not in _started:
        _started["multidevice"] = subprocess.Popen(
            [sys.executable, str(WORKERS / "multidevice.py")],
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
