"""How exact private training's clipping is at JAX's default matmul precision.

    python benchmarks/profile/private_precision.py [--quick] [--batch 16] [--json out.json]

On a GPU with matrix units (A100, H100), float32 dots at ``jax.default_matmul_precision``
'default' run in TF32 (a 10-bit mantissa), so both the per-example gradients and ghost
clipping's per-example norms (sums of products of per-example Gram matrices) carry its
rounding. For the benchmark's transformer and MLP (``_private_models``), this prints each
method's largest relative error against a float64 reference (``vmap(grad)`` under x64): of
the per-example norms, and of the clipped sum (each leaf's largest error over its largest
entry), at precision 'default' and 'highest'. On a CPU both precisions are float32.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder's helpers, then benchmarks/'s
import _private_models as models  # noqa: E402
import _timing  # noqa: E402

CLIP = 1.0


def reference(loss, params, batch):
    """Float64 per-example norms and the clipped sum's leaves (NumPy)."""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)
        b64 = jax.tree.map(
            lambda a: (
                jnp.asarray(np.asarray(a, np.float64))
                if jnp.issubdtype(a.dtype, jnp.floating)
                else jnp.asarray(a)
            ),
            batch,
        )
        one = lambda p, example: loss(p, jax.tree.map(lambda x: x[None], example))  # noqa: E731

        @jax.jit
        def norms_and_sum(p, b):
            grads = jax.vmap(jax.grad(one), in_axes=(None, 0))(p, b)
            flat = jnp.concatenate([g.reshape(g.shape[0], -1) for g in jax.tree.leaves(grads)], 1)
            norms = jnp.sqrt(jnp.sum(flat**2, axis=1))
            scales = jnp.minimum(1.0, CLIP / jnp.where(norms > 0, norms, 1.0))
            return norms, jax.tree.map(lambda g: jnp.tensordot(scales, g, (0, 0)), grads)

        norms, sums = norms_and_sum(p64, b64)
        return np.asarray(norms), [np.asarray(s) for s in jax.tree.leaves(sums)]


def errors(method, ref_norms, ref_sums) -> tuple[float, float]:
    grads, aux = method
    scale = np.maximum(ref_norms, np.finfo(np.float32).tiny)  # (an example of gradient 0)
    norm_err = float(np.max(np.abs(np.asarray(aux.grad_norms, np.float64) - ref_norms) / scale))
    sum_err = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - e)) / np.max(np.abs(e)))
        for a, e in zip(jax.tree.leaves(grads), ref_sums, strict=True)
    )
    return norm_err, sum_err


def main(argv=None) -> list[dict]:
    import jax_privacy

    import optclip

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models")
    parser.add_argument("--batch", type=_timing.count, default=16)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        t_shape = models.TransformerShape(d=32, seq=8, vocab=64, blocks=2, heads=2)
        m_shape = models.MLPShape(inputs=16, hidden=32, layers=2, classes=4)
    else:
        t_shape, m_shape = models.TransformerShape(), models.MLPShape()
    cases = {
        "transformer": (
            lambda p, b: models.transformer_loss(p, b, t_shape.heads),
            models.transformer_params(t_shape),
            models.transformer_batch(t_shape, args.batch),
        ),
        "mlp": (models.mlp_loss, models.mlp_params(m_shape), models.mlp_batch(m_shape, args.batch)),
    }
    rows = []
    print(f"{jax.devices()[0].device_kind}, batch {args.batch}, clip {CLIP}")
    print(f"{'model':<12} {'method':<26} {'precision':<9} {'norms':>9} {'clipped sum':>12}")
    for name, (loss, params, batch) in cases.items():
        ref_norms, ref_sums = reference(loss, params, batch)
        for precision in ("default", "highest"):
            for method, make in (
                ("optclip.clipped_grad", optclip.clipped_grad),
                ("jax_privacy.clipped_grad", jax_privacy.clipped_grad),
            ):
                step = make(loss, l2_clip_norm=CLIP, return_grad_norms=True)
                with jax.default_matmul_precision(precision):
                    out = jax.jit(step)(params, batch)
                norm_err, sum_err = errors(out, ref_norms, ref_sums)
                rows.append(
                    dict(
                        model=name,
                        method=method,
                        precision=precision,
                        norms=norm_err,
                        clipped_sum=sum_err,
                    )
                )
                print(f"{name:<12} {method:<26} {precision:<9} {norm_err:9.1e} {sum_err:12.1e}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
