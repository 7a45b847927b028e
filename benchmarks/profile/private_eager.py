"""Per-example clipping called eagerly (outside ``jax.jit``): its first call and a warm one.

    python benchmarks/profile/private_eager.py [--quick] [--warm 5] [--json out.json]

A notebook, a debugger or a test calls the clipped gradient without ``jax.jit``. The first call
compiles what it runs for its shapes; later calls reuse it. Side by side, on the private
benchmark's MLP and transformer (``benchmarks/private.py``) at batch 16:

* ``optclip.clipped_grad`` (an eager call runs as one compiled program);
* ``jax_privacy.clipped_grad`` (``vmap`` of ``grad``, its operations run one at a time);
* ``jax.grad`` of the summed loss, eager: the non-private floor.

Each contender's first call runs in a process of its own (a process keeps the operations it
has compiled, which would carry over from one contender to the next), followed by ``--warm``
calls, their median. Every figure is also a ratio to the non-private step's.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder's helpers, then benchmarks/'s
from private import GHOST, JAX_PRIVACY, NON_PRIVATE, contenders, where  # noqa: E402

WAYS = {"ghost": GHOST, "jax_privacy": JAX_PRIVACY, "non_private": NON_PRIVATE}


def setup(model: str, quick: bool, batch: int):
    """``(loss, params, batch)`` of the private benchmark's `model`."""
    import _private_models as models

    if model == "mlp":
        shape = models.MLPShape(inputs=16, hidden=32, layers=2, classes=4) if quick else None
        shape = shape or models.MLPShape()
        return models.mlp_loss, models.mlp_params(shape), models.mlp_batch(shape, batch)
    shape = models.TransformerShape(d=32, seq=8, vocab=64, blocks=2, heads=2) if quick else None
    shape = shape or models.TransformerShape()
    loss = functools.partial(models.transformer_loss, heads=shape.heads)
    return loss, models.transformer_params(shape), models.transformer_batch(shape, batch)


def one(model: str, way: str, quick: bool, batch: int, warm: int) -> dict:
    """In this process: `way`'s first eager call on `model` and `warm` more."""
    import _private_models as models
    import jax

    loss, params, data = setup(model, quick, batch)
    step = contenders(loss, batch, models.parameter_count(params), float("inf"))[WAYS[way]][0]
    times = []
    for _ in range(1 + warm):
        start = time.perf_counter()
        jax.block_until_ready(step(params, data))
        times.append(time.perf_counter() - start)
    return {"first_s": times[0], "warm_s": statistics.median(times[1:])}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warm", type=int, default=5, help="warm calls after the first")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warm < 1 or args.batch < 1:
        parser.error("--warm and --batch must be at least 1")
    if args.one:
        print(json.dumps(one(*args.one, args.quick, args.batch, args.warm)))
        return []
    import jax

    print(f"eager private calls: jax {jax.__version__}, {where()}, batch {args.batch}")
    rows = []
    for model in ("mlp", "transformer"):
        for way in WAYS:
            command = [sys.executable, __file__, "--one", model, way]
            command += ["--batch", str(args.batch), "--warm", str(args.warm)]
            command += ["--quick"] if args.quick else []
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append({"model": model, "method": WAYS[way], **json.loads(out.stdout)})
    floor = {r["model"]: r for r in rows if r["method"] == NON_PRIVATE}
    print(f"{'model':12} {'method':28} {'first call':>16} {'warm call':>18}")
    for r in rows:
        base = floor[r["model"]]
        r["first_ratio"] = r["first_s"] / base["first_s"]
        r["warm_ratio"] = r["warm_s"] / base["warm_s"]
        print(
            f"{r['model']:12} {r['method']:28} {r['first_s']:7.2f} s {r['first_ratio']:5.1f}x"
            f" {r['warm_s'] * 1e3:8.1f} ms {r['warm_ratio']:6.1f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
