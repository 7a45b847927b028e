"""Compiled peak memory of one DP-SGD gradient step: ghost clipping against the materialising
methods and the non-private floor.

For each model and batch size, XLA's memory analysis of the jitted step (arguments, outputs and
temporaries; the peak a device needs) for:

* ``grad``: ``jax.grad`` of the mean loss (non-private: the floor);
* ``ghost``: ``optclip.clipped_grad(..., method="auto")``;
* ``vmap``: ``optclip.clipped_grad(..., method="vmap")`` (``jax.vmap(jax.grad)`` + clip);
* ``jax_privacy``: ``jax_privacy.clipped_grad`` when it is installed.

Run: ``PYTHONPATH=src python benchmarks/ghost_memory.py [--batches 16 64 256] [--time]``.
Runs unchanged on a GPU (the numbers are then the GPU's).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import optclip


def mlp(d=512, layers=4, classes=10):
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = {
        f"w{i}": jax.random.normal(k, (d, d)) / np.sqrt(d) for i, k in enumerate(keys[:-1])
    } | {"out": jax.random.normal(keys[-1], (d, classes)) / np.sqrt(d)}

    def loss(p, x):
        h = x
        for i in range(layers):
            h = jax.nn.relu(h @ p[f"w{i}"])
        return jnp.mean(jax.nn.logsumexp(h @ p["out"], axis=-1))

    return loss, params, lambda b: jnp.ones((b, d))


def transformer(d=128, t=64, vocab=1024, blocks=4, heads=4):
    """Scanned pre-norm blocks (attention and MLP), tied embeddings."""
    k = jax.random.split(jax.random.key(1), 6)
    s = 1 / np.sqrt(d)
    params = {
        "embed": jax.random.normal(k[0], (vocab, d)) * s,
        "qkv": jax.random.normal(k[1], (blocks, 3, heads, d, d // heads)) * s,
        "o": jax.random.normal(k[2], (blocks, heads, d // heads, d)) * s,
        "up": jax.random.normal(k[3], (blocks, d, 4 * d)) * s,
        "down": jax.random.normal(k[4], (blocks, 4 * d, d)) * s / 2,
        "scale": jnp.ones((blocks, 2, d)),
    }

    def norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def block(h, p):
        qkv, o, up, down, scale = p
        a = norm(h, scale[0])
        q, kk, v = (jnp.einsum("btd,hde->bhte", a, qkv[i]) for i in range(3))
        att = jax.nn.softmax(jnp.einsum("bhte,bhse->bhts", q, kk) / np.sqrt(d // heads), -1)
        h = h + jnp.einsum("bhte,hed->btd", jnp.einsum("bhts,bhse->bhte", att, v), o)
        h = h + jax.nn.gelu(norm(h, scale[1]) @ up) @ down
        return h, None

    def loss(p, ids):
        h = jnp.take(p["embed"], ids, axis=0)
        h, _ = jax.lax.scan(block, h, (p["qkv"], p["o"], p["up"], p["down"], p["scale"]))
        logits = h @ p["embed"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], -1))

    return loss, params, lambda b: jnp.zeros((b, t), jnp.int32)


def steps(loss, jp):
    out = {
        "grad": jax.grad(lambda p, x: jnp.mean(jax.vmap(loss, (None, 0))(p, x[:, None]))),
        "ghost": optclip.clipped_grad(loss, l2_clip_norm=1.0).fun,
        "vmap": optclip.clipped_grad(loss, l2_clip_norm=1.0, method="vmap").fun,
    }
    if jp is not None:
        out["jax_privacy"] = jp.clipped_grad(loss, l2_clip_norm=1.0).fun
    return out


def peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--time", action="store_true", help="also time each step (median of 5)")
    args = parser.parse_args()
    try:
        import jax_privacy as jp
    except ImportError:
        jp = None
    print(f"device: {jax.devices()[0].device_kind}; memory in MiB (x the non-private step)")
    for name, build in (("mlp", mlp), ("transformer", transformer)):
        loss, params, data = build()
        for batch in args.batches:
            x = data(batch)
            row = []
            base = None
            for method, fn in steps(loss, jp).items():
                compiled = jax.jit(fn).lower(params, x).compile()
                mib = peak_bytes(compiled) / 2**20
                base = base or mib
                cell = f"{method} {mib:8.1f} ({mib / base:4.2f}x)"
                if args.time:
                    jax.block_until_ready(compiled(params, x))
                    times = []
                    for _ in range(5):
                        start = time.perf_counter()
                        jax.block_until_ready(compiled(params, x))
                        times.append(time.perf_counter() - start)
                    cell += f" {1e3 * float(np.median(times)):7.1f} ms"
                row.append(cell)
            print(f"{name:12s} B={batch:<4d} " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
