"""Where a step's compile goes: XLA's HLO passes, the emission of its kernels, LLVM.

    python benchmarks/profile/compile_phases.py [--only mlp-4 mlp-24] [--repeats 3]
                                                [--passes 8] [--json out.json]

``benchmarks/compile.py`` times trace, lowering and compile. This splits the compile of the
non-private step and of the ghost step (``optclip.clipped_grad``) on a CPU into the phases
XLA's CPU compiler logs (``TF_CPP_VMODULE=cpu_compiler=2,hlo_pass_pipeline=1``, set here before
JAX starts):

* ``passes_s``: the HLO passes (simplification, fusion, layout assignment, copy insertion...);
  they grow with the number of operations in the program;
* ``emit_s``: from the start of code generation to the LLVM modules handed to LLVM (each
  fusion's kernel emitted);
* ``llvm_s``: LLVM compiling those modules (a kernel the program already holds is not
  compiled again);
* ``compile_s``: ``lowered.compile()``'s wall time, which holds the three.

Each is the median over ``--repeats`` fresh compiles of a fresh step (``compile.measure_once``'s
way: JAX's caches cleared first). ``--passes N`` also prints the N HLO passes that took the
most time in the ghost step's last compile. The models are ``compile.py``'s (batch 16).
``JAX_DISABLE_MOST_OPTIMIZATIONS=1`` before the command measures the compile as the tests
do it (LLVM's optimizations off).
"""

from __future__ import annotations

import os

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # (info: the compile phases are logged there)
os.environ["TF_CPP_VMODULE"] = "cpu_compiler=2,hlo_pass_pipeline=1"

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _private_models as models  # noqa: E402
import _timing  # noqa: E402
import jax  # noqa: E402
from compile import BATCH, MODELS, machine, maker  # noqa: E402
from private import GHOST, NON_PRIVATE  # noqa: E402

METHODS = (NON_PRIVATE, GHOST)
_UNIT = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_PASS = re.compile(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s) ")
_WHOLE = re.compile(r"Running HLO passes on \[(\S+)\] for CPU time: ([\d.]+) (us|ms|s) ")


@contextlib.contextmanager
def _stderr_to(fd: int):
    """This process's stderr (file descriptor 2, where XLA logs) sent to `fd` meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _logged(lines: list):
    """The C++ log lines written to stderr meanwhile, appended to `lines` (not shown)."""
    with tempfile.TemporaryFile("w+") as log:
        with _stderr_to(log.fileno()):
            yield
        log.seek(0)
        lines.extend(log.read().splitlines())


def _clock(line: str) -> datetime.datetime:
    return datetime.datetime.strptime(line.split()[1], "%H:%M:%S.%f")


def phases(lines: list, module: str) -> tuple[dict, collections.Counter]:
    """The phases of `module`'s compile in `lines` (XLA's log), and each HLO pass's seconds."""
    at = lambda text: next(k for k, line in enumerate(lines) if text in line)  # noqa: E731
    try:
        whole = next(m for line in lines if (m := _WHOLE.search(line)) and m[1] == module)
        start = at(f"Compiling: {module}")
        llvm = next(k for k in range(start, len(lines)) if "Compile LLVM module" in lines[k])
        end = next(k for k in range(llvm, len(lines)) if "Compilation finished" in lines[k])
    except StopIteration:
        raise SystemExit(f"XLA logged no compile of {module}: is this JAX's CPU backend?") from None
    per_pass: collections.Counter = collections.Counter()
    first = next(k for k, line in enumerate(lines) if f"pipeline on module {module}" in line)
    for line in lines[first:start]:
        if m := _PASS.search(line):
            per_pass[m[1]] += float(m[2]) * _UNIT[m[3]]
    seconds = {
        "passes_s": float(whole[2]) * _UNIT[whole[3]],
        "emit_s": (_clock(lines[llvm]) - _clock(lines[start])).total_seconds(),
        "llvm_s": (_clock(lines[end]) - _clock(lines[llvm])).total_seconds(),
    }
    return seconds, per_pass


def measure_once(make, params, batch) -> tuple[dict, collections.Counter]:
    jax.clear_caches()
    jitted = jax.jit(make())
    lowered = jitted.trace(params, batch).lower()
    lines: list = []
    with _logged(lines):
        start = datetime.datetime.now()
        lowered.compile()
        took = (datetime.datetime.now() - start).total_seconds()
    module = re.search(r"module @(\S+?) ", lowered.as_text())[1]
    seconds, per_pass = phases(lines, module)
    return dict(seconds, compile_s=took), per_pass


def measure(name: str, repeats: int, passes: int | None) -> list[dict]:
    about, setup = MODELS[name]
    loss, params, batch = setup()
    n_params = models.parameter_count(params)
    rows = []
    for method in METHODS:
        make = maker(loss, method, n_params)
        measure_once(make, params, batch)  # (discarded: the first compile of each step)
        got = [measure_once(make, params, batch) for _ in range(repeats)]
        row = dict(model=name, about=about, batch=BATCH, method=method, repeats=repeats)
        for key in ("passes_s", "emit_s", "llvm_s", "compile_s"):
            row[key] = statistics.median(seconds[key] for seconds, _ in got)
        rows.append(row)
        print(
            f"{name}: {method}: HLO passes {row['passes_s']:.3f} s, emission "
            f"{row['emit_s']:.3f} s, LLVM {row['llvm_s']:.3f} s, compile {row['compile_s']:.3f} s",
            flush=True,
        )
        if passes and method == GHOST:
            for pass_name, s in got[-1][1].most_common(passes):
                print(f"    {s * 1e3:7.1f} ms  {pass_name}")
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS), default=["mlp-4", "mlp-24"])
    parser.add_argument("--repeats", type=_timing.count, default=3)
    parser.add_argument("--passes", type=_timing.count, help="the slowest HLO passes to list")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if jax.default_backend() != "cpu":
        parser.error("the phases are read from XLA's CPU compiler's log: run it on a CPU")
    jax.config.update("jax_enable_compilation_cache", False)  # (a cached program logs nothing)
    with open(os.devnull, "w") as devnull, _stderr_to(devnull.fileno()):  # (XLA's other logs)
        rows = [row for name in args.only for row in measure(name, args.repeats, args.passes)]
    if args.json:
        command = "python benchmarks/profile/compile_phases.py " + " ".join(argv or sys.argv[1:])
        args.json.write_text(json.dumps({"command": command, "machine": machine(), "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
