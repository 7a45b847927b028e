"""Private training's cost: per-example clipped gradients against an ordinary gradient step.

    python benchmarks/private.py [--quick] [--json out.json] [--plot memory.png]
    python benchmarks/private.py --only transformer --batches 64 256 --methods ghost
    python benchmarks/private.py --markdown benchmarks/results/private_cpu.json  (the guide's table)

Side by side in one process, for a transformer with scanned blocks (d=256, T=128, vocabulary
8192, 4 blocks) and an MLP, at batch sizes 16, 64 and 256 (``--only convnet``: a
depthwise-separable convolutional network on 32x32 images, 64 channels, 3 blocks):

* ``optclip.clipped_grad`` (ghost clipping: per-example norms from each layer's activations
  and output gradients, no per-example gradient formed);
* ``jax_privacy.clipped_grad`` (what JAX users run today: ``vmap`` of ``grad``), with its
  ``microbatch_size`` where the batch's per-example gradients would pass ``--budget-gib``;
* ``jax.vmap(jax.grad)`` + ``optclip.per_example_clip`` (materialised, then clipped);
* ``jax.grad`` of the summed loss: the non-private floor.

Memory is XLA's compiled memory analysis of each jitted step (arguments + outputs + temporaries,
less what outputs alias), so it needs no run; time is the median over rounds in which each
private method runs in turn with the non-private step alone (``_timing.interleaved``; with
jax_privacy, the ghost step too, for their own ratio), each called in a round until the
round takes 50 ms (the MLP's steps of milliseconds are not timed one call at a time), for the
contenders whose compiled peak is under ``--run-limit-gib``. Every figure is a ratio to the
non-private step measured in the same rounds. Runs unchanged on a GPU (the memory is then the
device's).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _private_models as models  # noqa: E402
import _timing  # noqa: E402

CLIP = 1.0
MIN_SAMPLE_S = 0.05  # each contender's calls in a round of timing (_timing.interleaved(each=True))
NON_PRIVATE = "jax.grad (non-private)"
GHOST = "optclip.clipped_grad"
JAX_PRIVACY = "jax_privacy.clipped_grad"
VMAP = "vmap(grad) + per_example_clip"
METHODS = {"ghost": GHOST, "jax_privacy": JAX_PRIVACY, "vmap": VMAP}  # (--methods)


def contenders(loss, batch_size: int, n_params: int, budget_bytes: float) -> dict:
    """``name -> (step(params, batch) -> summed gradients, note)``."""
    import jax_privacy

    import optclip

    def non_private(params, batch):
        return jax.grad(lambda p: loss(p, batch) * batch_size)(params)

    def materialised(params, batch):
        one = lambda p, example: loss(p, jax.tree.map(lambda x: x[None], example))  # noqa: E731
        grads = jax.vmap(jax.grad(one), in_axes=(None, 0))(params, batch)
        return optclip.per_example_clip(grads, CLIP)[0]

    per_example_bytes = 4.0 * n_params
    micro = batch_size
    while micro > 1 and micro * per_example_bytes > budget_bytes:
        micro //= 2
    jp_note = "" if micro == batch_size else f"microbatch_size={micro}"
    return {
        NON_PRIVATE: (non_private, ""),
        GHOST: (optclip.clipped_grad(loss, l2_clip_norm=CLIP), ""),
        JAX_PRIVACY: (
            jax_privacy.clipped_grad(
                loss, l2_clip_norm=CLIP, microbatch_size=None if micro == batch_size else micro
            ),
            jp_note,
        ),
        VMAP: (materialised, ""),
    }


def peak_bytes(compiled) -> int:
    mem = compiled.memory_analysis()
    return (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )


def measure(name, loss, params, batch, batch_size, args) -> list[dict]:
    n_params = models.parameter_count(params)
    made = contenders(loss, batch_size, n_params, args.budget_gib * 2**30)
    wanted = {NON_PRIVATE} | {METHODS[m] for m in args.methods}
    made = {name: step for name, step in made.items() if name in wanted}
    rows, runners = [], {}
    for method, (step, note) in made.items():
        start = time.perf_counter()
        compiled = jax.jit(step).lower(params, batch).compile()
        peak = peak_bytes(compiled)
        row = dict(model=name, batch=batch_size, method=method, peak_bytes=peak, note=note)
        row["compile_s"] = time.perf_counter() - start
        if peak <= args.run_limit_gib * 2**30:
            runners[method] = functools.partial(compiled, params, batch)
        else:
            row["note"] = (note + "; " if note else "") + "not run: peak over --run-limit-gib"
        rows.append(row)
        print(f"  {name} batch {batch_size}: {method}: peak {peak / 2**20:.1f} MiB", flush=True)
    by_method = {r["method"]: r for r in rows}
    for row in rows:
        row["peak_ratio"] = row["peak_bytes"] / by_method[NON_PRIVATE]["peak_bytes"]
    floor_times: list[float] = []
    for method in runners:
        if method == NON_PRIVATE:
            continue
        # Each method is timed in rounds with the floor alone (and, for jax_privacy, the ghost
        # step, for their own ratio): a round of a step of seconds that sweeps the caches with
        # gigabytes slowed the next rounds of the MLP's steps of milliseconds up to threefold.
        group = [NON_PRIVATE, method] + (
            [GHOST] if method == JAX_PRIVACY and GHOST in runners else []
        )
        paired = _timing.interleaved(
            [runners[m] for m in group],
            pairs=args.pairs,
            warmup=1,
            min_sample_s=MIN_SAMPLE_S,
            each=True,
        )
        floor_times += paired.times[0]
        row = by_method[method]
        row["time_s"] = paired.medians[1]
        row["time_ratio"] = paired.ratio(1, 0)
        row["time_iqr"] = paired.spread(1, 0)
        if len(group) == 3:
            by_method[GHOST]["vs_jax_privacy"] = paired.ratio(1, 2)
    if NON_PRIVATE in runners and not floor_times:  # (no private method ran)
        floor_times += _timing.interleaved(
            [runners[NON_PRIVATE]], pairs=args.pairs, warmup=1, min_sample_s=MIN_SAMPLE_S
        ).times[0]
    if floor_times:
        by_method[NON_PRIVATE]["time_s"] = statistics.median(floor_times)
        by_method[NON_PRIVATE]["time_ratio"] = 1.0
    return rows


def table(rows) -> str:
    head = (
        f"{'model':12} {'batch':>5}  {'method':32} {'peak MiB':>9} {'x floor':>7} "
        f"{'time':>9} {'x floor':>7}  note"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        t = f"{r['time_s'] * 1e3:7.1f}ms" if "time_s" in r else "        -"
        tr = f"{r['time_ratio']:7.2f}" if "time_ratio" in r else "      -"
        note = r["note"]
        if "vs_jax_privacy" in r:
            note = f"{r['vs_jax_privacy']:.2f}x faster than jax_privacy" + (
                "; " + note if note else ""
            )
        lines.append(
            f"{r['model']:12} {r['batch']:5d}  {r['method']:32} "
            f"{r['peak_bytes'] / 2**20:9.1f} {r['peak_ratio']:7.2f} {t} {tr}  {note}"
        )
    return "\n".join(lines)


def ratio(x: float) -> str:
    """A ratio as the guide prints it: two decimals below 10, none above."""
    return f"{x:.2f}x" if x < 10 else f"{x:.0f}x"


def markdown(rows) -> str:
    """The guide's table of a run (`--markdown`): per model and batch, ghost's memory and time,
    jax_privacy's memory and time, the materialising clip's memory, as ratios to the
    non-private step."""
    lines = [
        "| model, batch | `clipped_grad` memory | time | `jax_privacy.clipped_grad` memory "
        "| time | `vmap(grad)` + clip memory |",
        "|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["model"], r["batch"]) for r in rows}, key=lambda k: (k[0] == "mlp", k[1]))
    for model, batch in keys:
        got = {r["method"]: r for r in rows if (r["model"], r["batch"]) == (model, batch)}
        name = "MLP" if model == "mlp" else model
        lines.append(f"| {name}, {batch} | " + " | ".join(cells(got)) + " |")
    return "\n".join(lines)


def cells(got: dict) -> list[str]:
    """`markdown`'s cells of one model and batch (``got``: its rows by method): ghost's memory
    and time, jax_privacy's memory (with its microbatch) and time, the materialising clip's
    memory, as ratios to the non-private step; ``-`` for a method not run."""
    out = []
    for method, with_time in ((GHOST, True), (JAX_PRIVACY, True), (VMAP, False)):
        row = got.get(method)
        memory = ratio(row["peak_ratio"]) if row else "-"
        if row and "microbatch" in row["note"]:
            memory += f" (`{row['note'].split(';')[0]}`)"
        out.append(memory)
        if with_time:
            out.append(ratio(row["time_ratio"]) if row and "time_ratio" in row else "-")
    return out


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    names = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, model in zip(axes[0], names):
        for method in (NON_PRIVATE, GHOST, JAX_PRIVACY, VMAP):
            points = sorted(
                (r["batch"], r["peak_bytes"] / 2**20)
                for r in rows
                if r["model"] == model and r["method"] == method
            )
            if not points:  # (a method left out by --methods)
                continue
            ax.plot(*zip(*points), marker="o", label=method)
            for r in rows:
                if r["model"] == model and r["method"] == method and "microbatch" in r["note"]:
                    micro = r["note"].split(";")[0]
                    ax.annotate(
                        micro,
                        (r["batch"], r["peak_bytes"] / 2**20),
                        fontsize=7,
                        xytext=(-100, -16),
                        textcoords="offset points",
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["batch"] for r in rows}))
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("batch size")
        ax.set_ylabel("peak memory of the jitted step (MiB)")
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"Peak memory of one step (XLA's compiled memory analysis, {where()})")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)


def load_rows(path: pathlib.Path) -> list[dict]:
    """The rows of a ``--json`` file (`save_run`'s ``{"command", "machine", "rows"}``; an
    older file's bare list of rows too)."""
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


def save_run(path: pathlib.Path, rows: list[dict], machine: str) -> None:
    """Writes `rows` as ``benchmarks/results/`` keeps a run: with the command that made it,
    the ``XLA_FLAGS`` it ran under (where set: they change what XLA compiles) and the machine
    it ran on."""
    command = " ".join(["python", *sys.argv])
    run: dict = {"command": command, "machine": machine, "rows": rows}
    if os.environ.get("XLA_FLAGS"):
        run["xla_flags"] = os.environ["XLA_FLAGS"]
    path.write_text(json.dumps(run, indent=1, default=float))


def where() -> str:
    """The machine the figures come from: on a CPU its model (`_timing.cpu_model`) and its
    cores."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return device.device_kind
    return f"{_timing.cpu_model()}, {os.cpu_count()} cores"


def announce(what: str, quick: bool) -> None:
    """Prints the run's first line: what it measures, with which jax, on which machine."""
    flags = f", XLA_FLAGS={os.environ['XLA_FLAGS']}" if os.environ.get("XLA_FLAGS") else ""
    print(
        f"{what}: jax {jax.__version__}, {where()} "
        f"({platform.processor() or platform.machine()}), {'quick' if quick else 'full'}{flags}",
        flush=True,
    )


def add_arguments(parser, models: list[str], *, quick: str, only: str, several=False) -> None:
    """The options this script shares with the scripts that measure other models as it does
    (``recurrent.py``): ``--quick``, ``--pairs``, ``--budget-gib``, ``--run-limit-gib``,
    ``--only`` (one of `models`, or with `several` a list of them), ``--batches``,
    ``--methods`` and ``--json``."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--pairs", type=_timing.count, default=None, help="timing rounds (default 5)"
    )
    parser.add_argument("--budget-gib", type=_timing.gib, default=4.0)
    parser.add_argument("--run-limit-gib", type=_timing.gib, default=12.0)
    nargs = "+" if several else None
    parser.add_argument("--only", choices=models, nargs=nargs, default=None, help=only)
    parser.add_argument(
        "--batches", type=_timing.count, nargs="+", default=None, help="batch sizes"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=sorted(METHODS),
        default=sorted(METHODS),
        help="the private methods run next to the non-private step (default: all)",
    )
    parser.add_argument("--json", type=pathlib.Path, default=None)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(
        parser,
        ["transformer", "mlp", "convnet"],
        quick="tiny models, two batch sizes",
        only="one model (the convnet runs only when named here)",
    )
    parser.add_argument("--replot", type=pathlib.Path, default=None, help="plot a --json file")
    parser.add_argument(
        "--markdown", type=pathlib.Path, default=None, help="print a --json file's guide table"
    )
    parser.add_argument("--plot", type=pathlib.Path, default=None, help="a .png or .svg file")
    args = parser.parse_args(argv)
    args.pairs = args.pairs or (2 if args.quick else 5)
    if args.markdown:
        rows = load_rows(args.markdown)
        print(markdown(rows))
        return rows
    if args.replot:
        rows = load_rows(args.replot)
        plot(rows, args.plot)
        return rows
    if args.quick:
        t_shape = models.TransformerShape(d=32, seq=8, vocab=64, blocks=2, heads=2)
        m_shape = models.MLPShape(inputs=16, hidden=32, layers=2, classes=4)
        c_shape = models.ConvShape(size=8, channels=8, blocks=2)
        batches = (4, 8)
    else:
        t_shape, m_shape, batches = models.TransformerShape(), models.MLPShape(), (16, 64, 256)
        c_shape = models.ConvShape()
    batches = tuple(args.batches) if args.batches else batches
    announce("private training benchmark", args.quick)
    rows = []
    # The MLP first: after the transformer's steps of gigabytes, glibc's malloc handed the
    # MLP's buffers of megabytes back to the system after each call (fresh pages at the next),
    # and its steps took 1.3x their time, the ghost step's (more buffers) the most: 1.22x the
    # non-private step where a process of its own gave 1.14x.
    setups = {
        "mlp": (
            models.mlp_loss,
            models.mlp_params(m_shape),
            lambda b: models.mlp_batch(m_shape, b),
        ),
        "transformer": (
            functools.partial(models.transformer_loss, heads=t_shape.heads),
            models.transformer_params(t_shape),
            lambda b: models.transformer_batch(t_shape, b),
        ),
        "convnet": (
            models.convnet_loss,
            models.convnet_params(c_shape),
            lambda b: models.convnet_batch(c_shape, b),
        ),
    }
    for name, (loss, params, make_batch) in setups.items():
        if name != args.only and (args.only or name == "convnet"):
            continue
        print(f"{name}: {models.parameter_count(params):,} parameters", flush=True)
        for b in batches:
            rows += measure(name, loss, params, make_batch(b), b, args)
    print(table(rows))
    if args.json:
        save_run(args.json, rows, f"{where()}, jax {jax.__version__}")
    if args.plot:
        plot(rows, args.plot)
    assert all(math.isfinite(r["peak_bytes"]) for r in rows)
    return rows


if __name__ == "__main__":
    main()
