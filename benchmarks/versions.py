"""optclip against an earlier optclip, side by side, in one process.

    python benchmarks/versions.py HEAD~3          # the working tree vs commit HEAD~3
    python benchmarks/versions.py main --quick    # tiny shapes: a smoke test

A change to the norm or the scale must not slow the common path down. This script checks that
directly: it exports `src/optclip` at the given git ref into a temporary folder as a package of
another name (`optclip_base`), imports both, and times the rows of `benchmarks/run.py` that
the norm and the scale decide (the global norm of a transformer's gradients, the norm of 2000
small leaves, and the clip+adam step in float32 and bfloat16) with the same interleaved,
rotating rounds (`_timing.interleaved`). Each figure is the median over rounds of the
per-round ratio (working tree / base), with its interquartile range.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing  # noqa: E402
import _trees  # noqa: E402
from run import machine  # noqa: E402

import optclip  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_base(ref: str, folder: str):
    """`src/optclip` at git `ref`, imported as the package `optclip_base`."""
    archive = subprocess.run(
        ["git", "archive", ref, "src/optclip"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    target = os.path.join(folder, "optclip_base")
    os.makedirs(target)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                text = tar.extractfile(member).read().decode()
                text = re.sub(r"\boptclip\b(?=[._ ]|$)", "optclip_base", text, flags=re.M)
                path = os.path.join(target, os.path.relpath(member.name, "src/optclip"))
                os.makedirs(os.path.dirname(path), exist_ok=True)  # (subpackages: ghost/)
                with open(path, "w") as f:
                    f.write(text)
    sys.path.insert(0, folder)
    import optclip_base

    return optclip_base


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="the git commit (or branch) to compare with")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few rounds")
    parser.add_argument("--pairs", type=_timing.count, default=None, help="rounds per figure")
    args = parser.parse_args(argv)
    pairs = args.pairs or (5 if args.quick else 21)
    shape = _trees.TransformerShape.quick() if args.quick else _trees.TransformerShape()
    leaves = (200, 100) if args.quick else (2000, 1000)
    with tempfile.TemporaryDirectory() as folder:
        base = import_base(args.ref, folder)
        info = machine()
        print(
            f"optclip (working tree) vs optclip at {args.ref}; jax {info['jax']}; "
            f"{info['nproc']} x {info['cpu']}; {info['backend']}"
        )
        print(f"{'figure':<34} {'ratio':>6}  {'IQR':>11}  {'new':>9}  {'base':>9}")
        rows = []
        transformer = _trees.transformer_shapes(shape)
        for name, tree in (
            ("global_norm, transformer float32", _trees.random_tree(transformer)),
            (f"global_norm, {leaves[0]} leaves x {leaves[1]}", _trees.many_leaves(*leaves)),
        ):
            new, old = jax.jit(optclip.global_norm), jax.jit(base.global_norm)
            rows.append((name, [lambda f=new, t=tree: f(t), lambda f=old, t=tree: f(t)]))
        for dtype in (jnp.float32, jnp.bfloat16):
            grads = _trees.random_tree(transformer, dtype)
            runners = []
            for lib in (optclip, base):
                opt = optax.chain(lib.global_clip(1.0), optax.adam(1e-3))
                step, box = jax.jit(opt.update, donate_argnums=(1,)), [opt.init(grads)]

                def run(step=step, box=box, grads=grads):
                    updates, box[0] = step(grads, box[0])
                    return updates

                runners.append(run)
            rows.append((f"global_clip+adam step, {jnp.dtype(dtype).name}", runners))
        for name, fns in rows:
            paired = _timing.interleaved(fns, pairs=pairs)
            lo, hi = paired.spread(0, 1)
            new_s, old_s = paired.medians
            print(
                f"{name:<34} {paired.ratio(0, 1):6.3f}  {lo:5.3f}-{hi:5.3f}  "
                f"{new_s * 1e3:7.2f}ms  {old_s * 1e3:7.2f}ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
