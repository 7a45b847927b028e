"""Private training's compile cost: tracing, lowering and compiling a private step beside a
non-private one.

    python benchmarks/compile.py [--quick] [--repeats 3] [--json out.json]
    python benchmarks/compile.py --only unrolled-12 unrolled-24 scanned-24
    python benchmarks/compile.py --markdown benchmarks/results/compile_cpu.json  (a saved run)

A jitted step is compiled once per shape, and again in every new process: each run of a
script, each test, each point of a sweep pays it before its first step. Side by side in one
process, for each model at batch 16:

* ``jax.grad`` of the summed loss: the non-private step, the reference of every ratio;
* ``optclip.clipped_grad`` (ghost clipping: the loss is traced and each parameter's uses are
  found in Python at trace time; the program computes the norms and the clipped sum from the
  layers' inputs and output gradients);
* ``jax_privacy.clipped_grad`` (``vmap`` of ``grad``: a per-example copy of the backward pass),

both private steps built as ``benchmarks/private.py`` builds them (its ``contenders``:
``l2_clip_norm=1.0``, the batch the second argument, the loss of one example its batch of one).
The models (``benchmarks/_private_models.py``, float32, fixed random weights):

* ``unrolled-2``, ``-6``, ``-12``, ``-24``: a GPT-2-like decoder (d=64, 4 heads, T=12 tokens,
  vocabulary 512, learned positions, pre-LayerNorm blocks of causal attention and a 4x GELU
  MLP) with its blocks a Python list: the program grows with the depth, and so does what the
  ghost engine traces and builds for each use of a weight;
* ``scanned-24``: the same decoder, 24 blocks stacked and applied with ``lax.scan`` (the
  private benchmark's transformer at this small shape): one block's program at any depth;
* ``mlp-4``, ``mlp-24``: a ReLU MLP of 4 and 24 hidden layers of width 64 (many leaves);
* ``convnet``: the private benchmark's depthwise-separable convnet, 16x16 images, 16 channels.

Measured, for each model and method: the seconds to trace and lower ``jax.jit(step)`` on the
concrete parameters and batch (``.trace(...).lower()``), the seconds to compile it
(``.compile()``), the lines of its StableHLO (``lowered.as_text()``) and the number of those
lines holding a conditional (``stablehlo.case`` or ``stablehlo.if``: a ``lax.cond`` or
``switch`` that XLA keeps as a branch). Each measurement is of a fresh step (a new closure over
a new wrapper of the loss) after ``jax.clear_caches()``, as ``_timing.compile_time`` does, so
that no trace, lowering or executable cache answers; the persistent compilation cache is off
unless configured. Each of ``--repeats`` rounds measures every method once, their order rotated
from round to round (``_timing.rotated_orders``); the figures are medians over rounds, the
ratio the median over rounds of a private step's total to the non-private step's in the same
round (``_timing.Paired``). A first, discarded round on a tiny MLP absorbs the process's
one-off costs (imports, the backend's start).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import pathlib
import statistics
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _private_models as models  # noqa: E402
import _timing  # noqa: E402
from private import GHOST, JAX_PRIVACY, NON_PRIVATE, contenders, load_rows, save_run  # noqa: E402

METHODS = (NON_PRIVATE, GHOST, JAX_PRIVACY)
BATCH = 16
QUICK = ("unrolled-2", "mlp-4")
CONDITIONALS = ("stablehlo.case", "stablehlo.if")


def _unrolled(blocks: int):
    def setup():
        params = models.unrolled_transformer_params(blocks)  # (d=64, T=12, vocab 512, 4 heads)
        return models.unrolled_transformer_loss, params, models.unrolled_transformer_batch(BATCH)

    about = f"GPT-2-like, blocks a list: d=64, 4 heads, T=12, vocab 512, {blocks} blocks"
    return about, setup


def _scanned(blocks: int):
    shape = models.TransformerShape(d=64, seq=12, vocab=512, blocks=blocks, heads=4)

    def setup():
        loss = functools.partial(models.transformer_loss, heads=shape.heads)
        return loss, models.transformer_params(shape), models.transformer_batch(shape, BATCH)

    about = f"blocks stacked, lax.scan: d=64, 4 heads, T=12, vocab 512, {blocks} blocks"
    return about, setup


def _mlp(layers: int):
    shape = models.MLPShape(inputs=64, hidden=64, layers=layers, classes=10)

    def setup():
        return models.mlp_loss, models.mlp_params(shape), models.mlp_batch(shape, BATCH)

    return f"ReLU MLP: 64 inputs, {layers} hidden layers of 64, 10 classes", setup


def _convnet():
    shape = models.ConvShape(size=16, channels=16, blocks=3, classes=10)

    def setup():
        return models.convnet_loss, models.convnet_params(shape), models.convnet_batch(shape, BATCH)

    return "depthwise-separable convnet: 16x16x3 images, 16 channels, 3 blocks", setup


MODELS = {
    **{f"unrolled-{n}": _unrolled(n) for n in (2, 6, 12, 24)},
    "scanned-24": _scanned(24),
    **{f"mlp-{n}": _mlp(n) for n in (4, 24)},
    "convnet": _convnet(),
}


def maker(loss, method: str, n_params: int):
    """A function that builds a fresh `method` step on every call: a new wrapper of `loss` and
    a new step around it (``contenders`` makes new closures), so no cache keyed on either
    answers."""

    def make():
        def fresh_loss(params, batch):
            return loss(params, batch)

        return contenders(fresh_loss, BATCH, n_params, float("inf"))[method][0]

    return make


def measure_once(make, params, batch) -> dict:
    """One fresh step's trace, lowering and compilation (seconds) and its program."""
    jax.clear_caches()  # (inner jitted helpers would otherwise answer from their trace cache)
    gc.collect()  # (the last step's garbage not collected inside this one's timing)
    jitted = jax.jit(make())
    start = time.perf_counter()
    traced = jitted.trace(params, batch)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    lines = lowered.as_text().splitlines()
    return {
        "trace_s": traced_at - start,
        "lower_s": lowered_at - traced_at,
        "trace_lower_s": lowered_at - start,
        "compile_s": done - lowered_at,
        "total_s": done - start,
        "lines": len(lines),
        "conditionals": sum(any(c in line for c in CONDITIONALS) for line in lines),
    }


def measure(name: str, repeats: int, machine: dict) -> list[dict]:
    about, setup = MODELS[name]
    loss, params, batch = setup()
    n_params = models.parameter_count(params)
    makers = [maker(loss, method, n_params) for method in METHODS]
    samples: list[list[dict]] = [[] for _ in METHODS]
    for order in _timing.rotated_orders(len(METHODS), repeats):
        for k in order:
            samples[k].append(measure_once(makers[k], params, batch))
    keys = ("trace_s", "lower_s", "trace_lower_s", "compile_s", "total_s")
    totals = _timing.Paired(tuple(tuple(s["total_s"] for s in got) for got in samples))
    rows = []
    for k, (method, got) in enumerate(zip(METHODS, samples)):
        row = dict(model=name, about=about, parameters=n_params, batch=BATCH, method=method)
        row.update({key: statistics.median(s[key] for s in got) for key in keys})
        row["total_ratio"] = totals.ratio(k, 0)
        row["lines"], row["conditionals"] = got[-1]["lines"], got[-1]["conditionals"]
        row["lines_ratio"] = row["lines"] / samples[0][-1]["lines"]
        rows.append(dict(row, repeats=repeats, **machine))
        print(
            f"  {name}: {method}: {row['total_s']:.2f} s ({row['total_ratio']:.2f}x), "
            f"{row['lines']} lines",
            flush=True,
        )
    return rows


def warm_up() -> None:
    """A discarded round on a tiny MLP: the first compilation of the process pays the imports
    and the backend's start, which would fall on whichever method came first."""
    shape = models.MLPShape(inputs=4, hidden=4, layers=1, classes=2)
    params, batch = models.mlp_params(shape), models.mlp_batch(shape, BATCH)
    for method in METHODS:
        measure_once(maker(models.mlp_loss, method, 0), params, batch)


def machine() -> dict:
    """Where and when the figures were measured (kept in each row of ``--json``)."""
    device = jax.devices()[0]
    return {
        "processor": _timing.cpu_model(),
        "cores": os.cpu_count(),
        "platform": device.platform,
        "device": device.device_kind,
        "jax": jax.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def ratio(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.0f}x"


def seconds(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def markdown(rows) -> str:
    """The table of a run: per model and method, the medians of its times, its ratio to the
    non-private step, its program's size and conditionals; then each model's shape."""
    first = rows[0]
    where = first["device"] if first["platform"] != "cpu" else f"CPU, {first['cores']} cores"
    lines = [
        f"Compile cost at batch {first['batch']}: jax {first['jax']}, {where} "
        f"({first['processor']}), {first['date']}, median of {first['repeats']} round(s).",
        "",
        "| model | method | trace+lower s | compile s | total s | x plain | lines | x plain "
        "| conditionals |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['method']} | {seconds(r['trace_lower_s'])} "
            f"| {seconds(r['compile_s'])} | {seconds(r['total_s'])} | {ratio(r['total_ratio'])} "
            f"| {r['lines']} | {ratio(r['lines_ratio'])} | {r['conditionals']} |"
        )
    lines.append("")
    about = {r["model"]: (r["about"], r["parameters"]) for r in rows}
    for name, (what, n_params) in about.items():
        lines.append(f"- `{name}`: {what}; {n_params:,} parameters")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, one round")
    parser.add_argument("--only", nargs="+", choices=list(MODELS), default=None, metavar="NAME")
    parser.add_argument(
        "--repeats", type=_timing.count, default=None, help="rounds (default 3, --quick 1)"
    )
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the rows here")
    parser.add_argument(
        "--markdown", type=pathlib.Path, default=None, help="print a --json file's table"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        rows = load_rows(args.markdown)
        print(markdown(rows))
        return rows
    repeats = args.repeats or (1 if args.quick else 3)
    names = args.only or (QUICK if args.quick else list(MODELS))
    where = machine()
    print(
        f"compile benchmark: jax {where['jax']}, {where['device']} ({where['processor']}), "
        f"{len(names)} model(s), {repeats} round(s)",
        flush=True,
    )
    warm_up()
    rows = []
    for name in names:
        rows += measure(name, repeats, where)
    print()
    print(markdown(rows))
    if args.json:
        where = machine()
        chip = where["processor"] if where["platform"] == "cpu" else where["device"]
        save_run(args.json, rows, f"{chip}, {where['cores']} cores, jax {where['jax']}")
    return rows


if __name__ == "__main__":
    main()
