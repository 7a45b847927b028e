"""Gradient-shaped pytrees for the benchmarks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    vocab: int = 32000
    d_model: int = 512
    n_blocks: int = 12
    mlp_ratio: int = 4

    @classmethod
    def quick(cls) -> TransformerShape:
        return cls(vocab=1000, d_model=64, n_blocks=2)


def transformer_shapes(cfg: TransformerShape) -> dict:
    """Parameter shapes of a GPT-like model: 10 leaves a block, plus embedding and final norm.

    The default is 54.2M parameters in 123 leaves: embedding 32000x512, 12 blocks of fused
    qkv (512x1536), attention output (512x512), MLP in/out (512x2048, 2048x512, with biases)
    and two layer norms (scale, bias).
    """
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    block = {
        "ln1": {"scale": (d,), "bias": (d,)},
        "attn": {"qkv": (d, 3 * d), "out": (d, d)},
        "ln2": {"scale": (d,), "bias": (d,)},
        "mlp": {"w_in": (d, h), "b_in": (h,), "w_out": (h, d), "b_out": (d,)},
    }
    return {
        "embed": (cfg.vocab, d),
        "blocks": [block for _ in range(cfg.n_blocks)],
        "ln_f": {"scale": (d,), "bias": (d,)},
    }


def stacked_transformer_shapes(cfg: TransformerShape) -> dict:
    """The same model scanned (`nn.scan`, `nnx.vmap`, MaxText): each of the 10 leaves of a block
    holds every block's weights along a leading layer axis (``(n_blocks, 512, 1536)``)."""
    shapes = transformer_shapes(cfg)
    block = shapes["blocks"][0]
    shapes["blocks"] = jax.tree.map(lambda s: (cfg.n_blocks, *s), block, is_leaf=_is_shape)
    return shapes


def mlp_shapes(widths: tuple[int, ...]) -> list:
    """Parameter shapes of a dense network: a weight and a bias per layer, in order
    (``(784, 256, 256, 10)``: 3 layers, 6 leaves, 269,322 parameters)."""
    shapes = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        shapes += [(fan_in, fan_out), (fan_out,)]
    return shapes


def numpy_tree(shapes, dtype=jnp.float32, seed: int = 0, scale: float = 1.0):
    """Like `random_tree`, drawn with NumPy: no JAX compilation per distinct shape (which costs
    seconds in ``--quick`` mode)."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    rng = np.random.default_rng(seed)
    out = [jnp.asarray(scale * rng.standard_normal(s, dtype=np.float32), dtype) for s in leaves]
    return jax.tree.unflatten(treedef, out)


def per_example(shapes, n: int) -> list:
    """The same shapes with a leading batch axis of ``n`` examples, as a list."""
    return [(n, *s) for s in jax.tree.leaves(shapes, is_leaf=_is_shape)]


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def random_tree(shapes, dtype=jnp.float32, seed: int = 0, scale: float = 1e-3):
    """Normal leaves of the given shapes (generated leaf by leaf to keep peak memory low)."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [
        (scale * jax.random.normal(k, s, jnp.float32)).astype(dtype) for k, s in zip(keys, leaves)
    ]
    return jax.tree.unflatten(treedef, out)


def many_leaves(n_leaves: int, size: int, dtype=jnp.float32, seed: int = 0) -> list:
    """``n_leaves`` vectors of ``size`` elements, as one list (a flat tree)."""
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((n_leaves, size), dtype=np.float32)
    return [jnp.asarray(row, dtype) for row in data]


def n_params(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def n_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


ACCURACY_SIZES = (1, 3, 64, 512, 1000, 4096)


def accuracy_tree(n_leaves: int, dtype, seed: int) -> list:
    """Leaves of mixed sizes (1 to 4096) and per-leaf scales spread over three decades.

    Sizes come from a short list, as in a real model where shapes repeat (every distinct
    shape costs its own kernels: 100 leaves of 100 distinct sizes take ~30 s to compile on
    either side). They depend on ``n_leaves`` only, so one compilation serves every seed;
    the scales and values depend on ``seed``. Scales stay small enough that float16 squares
    and per-leaf float16 sums of squares do not overflow, so the figure measures rounding,
    not overflow (overflow has its own tests).
    """
    sizes = np.random.default_rng(n_leaves).choice(ACCURACY_SIZES, size=n_leaves)
    rng = np.random.default_rng([n_leaves, seed])
    scales = 10.0 ** rng.uniform(-3.0, 0.0, size=n_leaves)
    return [
        jnp.asarray((s * rng.standard_normal(int(n))).astype(np.float32), dtype)
        for n, s in zip(sizes, scales)
    ]


def float64_norm(tree) -> float:
    """The reference: the exact values of the (low-precision) leaves, summed in float64."""
    total = 0.0
    for x in jax.tree.leaves(tree):
        a = np.asarray(x.astype(jnp.float32), dtype=np.float64)
        total += float(np.sum(a * a))
    return float(np.sqrt(total))
