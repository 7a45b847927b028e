"""The models of the private-training benchmark (benchmarks/private.py), in plain JAX.

* ``transformer``: a decoder of ``blocks`` pre-LayerNorm blocks (causal multi-head attention,
  a GELU MLP of width 4d), their weights stacked on a leading layer axis and applied with
  ``lax.scan`` (as ``nn.scan``, ``nnx.scan`` and MaxText lay them out), a token embedding, a
  learned position embedding, a final LayerNorm and an output projection; the loss of one
  example is its mean next-token cross-entropy.
* ``unrolled_transformer``: the same decoder with its blocks a Python list, each block's
  weights a tree of its own, applied one after another (unrolled: the program grows with the
  depth, as a model written with a ``for`` loop over its layers does).
* ``mlp``: a ReLU MLP on flat inputs with a softmax cross-entropy.
* ``convnet``: a depthwise-separable convolutional network (MobileNet's blocks): a 3x3 stem,
  ``blocks`` residual blocks of a depthwise 3x3 convolution (a group per channel) and a
  pointwise 1x1 one, average pooling and a dense head, on NHWC images; cross-entropy.

Each ``loss(params, batch)`` takes a batch with a leading axis (``jax_privacy``'s
``keep_batch_dim=True`` convention: one example is a batch of one) and returns the mean loss.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# The models of benchmarks/recurrent.py, by name (here, where tools that build their own
# parsers read them without importing Equinox).
RECURRENT_MODELS = (
    "eqx-gru",
    "eqx-lstm-lm",
    "flax-lstm",
    "flax-gru",
    "jax-lstm",
    "hk-deeprnn",
    "eqx-convnet",
)


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    d: int = 256
    seq: int = 128
    vocab: int = 8192
    blocks: int = 4
    heads: int = 4


def transformer_params(shape: TransformerShape, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    d, L = shape.d, shape.blocks

    def normal(*dims, scale=0.02):
        return jnp.asarray(rng.standard_normal(dims) * scale, jnp.float32)

    block = {
        "ln1": {"scale": jnp.ones((L, d)), "bias": jnp.zeros((L, d))},
        "qkv": normal(L, d, 3 * d),
        "out": normal(L, d, d),
        "ln2": {"scale": jnp.ones((L, d)), "bias": jnp.zeros((L, d))},
        "up": {"kernel": normal(L, d, 4 * d), "bias": jnp.zeros((L, 4 * d))},
        "down": {"kernel": normal(L, 4 * d, d), "bias": jnp.zeros((L, d))},
    }
    return {
        "embed": normal(shape.vocab, d),
        "position": normal(shape.seq, d),
        "blocks": block,
        "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "head": normal(d, shape.vocab),
    }


def _layer_norm(x, p):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _block(x, p, heads: int):
    b, t, d = x.shape
    h = _layer_norm(x, p["ln1"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // heads)  # (keeps the dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    attended = jnp.einsum("bhqk,bkhc->bqhc", weights, v).reshape(b, t, d)
    x = x + attended @ p["out"]
    h = _layer_norm(x, p["ln2"])
    h = jax.nn.gelu(h @ p["up"]["kernel"] + p["up"]["bias"])
    return x + h @ p["down"]["kernel"] + p["down"]["bias"]


def _decoder_loss(params, tokens, blocks):
    """Mean next-token cross-entropy of `tokens` (batch, seq + 1) of ints, the embedded inputs
    passed through ``blocks(x)``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["position"][: inputs.shape[1]]
    logits = _layer_norm(blocks(x), params["ln_f"]) @ params["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def transformer_loss(params, tokens, heads: int = 4):
    """Mean next-token cross-entropy of `tokens` (batch, seq + 1) of ints."""

    def blocks(x):
        return jax.lax.scan(lambda x, p: (_block(x, p, heads), None), x, params["blocks"])[0]

    return _decoder_loss(params, tokens, blocks)


def transformer_batch(shape: TransformerShape, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, shape.vocab, (batch, shape.seq + 1)), jnp.int32)


def unrolled_transformer_params(
    blocks: int, d: int = 64, seq: int = 12, vocab: int = 512, heads: int = 4, seed: int = 0
) -> dict:
    """The parameters of `transformer_params` (the same values) with ``"blocks"`` a list of
    `blocks` trees, one a block."""
    shape = TransformerShape(d=d, seq=seq, vocab=vocab, blocks=blocks, heads=heads)
    params = transformer_params(shape, seed)
    stacked = params["blocks"]
    params["blocks"] = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(blocks)]
    return params


def unrolled_transformer_loss(params, tokens, heads: int = 4):
    """`transformer_loss` with the blocks applied by a Python loop (the same function)."""

    def blocks(x):
        for p in params["blocks"]:
            x = _block(x, p, heads)
        return x

    return _decoder_loss(params, tokens, blocks)


def unrolled_transformer_batch(batch: int, seq: int = 12, vocab: int = 512, seed: int = 1):
    return transformer_batch(TransformerShape(seq=seq, vocab=vocab), batch, seed)


@dataclasses.dataclass(frozen=True)
class MLPShape:
    inputs: int = 784
    hidden: int = 512
    layers: int = 2
    classes: int = 10


def mlp_params(shape: MLPShape, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    sizes = [shape.inputs] + [shape.hidden] * shape.layers + [shape.classes]
    return {
        f"dense{i}": {
            "kernel": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
            "bias": jnp.zeros(b),
        }
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))
    }


def mlp_loss(params, batch):
    x, labels = batch
    for i in range(len(params)):
        layer = params[f"dense{i}"]
        x = x @ layer["kernel"] + layer["bias"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    logp = jax.nn.log_softmax(x, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def mlp_batch(shape: MLPShape, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, shape.inputs)), jnp.float32)
    return x, jnp.asarray(rng.integers(0, shape.classes, batch), jnp.int32)


@dataclasses.dataclass(frozen=True)
class ConvShape:
    size: int = 32
    channels: int = 64
    blocks: int = 3
    classes: int = 10


def convnet_params(shape: ConvShape, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    c = shape.channels

    def normal(*dims, fan_in):
        return jnp.asarray(rng.standard_normal(dims) / np.sqrt(fan_in), jnp.float32)

    params = {"stem": normal(3, 3, 3, c, fan_in=27), "head": normal(c, shape.classes, fan_in=c)}
    for i in range(shape.blocks):
        params[f"block{i}"] = {
            "depthwise": normal(3, 3, 1, c, fan_in=9),
            "pointwise": normal(1, 1, c, c, fan_in=c),
        }
    return params


def _conv(x, kernel, groups=1):
    return jax.lax.conv_general_dilated(
        x,
        kernel,
        (1, 1),
        "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups,
    )


def convnet_loss(params, batch):
    images, labels = batch
    h = jax.nn.relu(_conv(images, params["stem"]))
    for i in range(len(params) - 2):
        block = params[f"block{i}"]
        mixed = jax.nn.relu(_conv(h, block["depthwise"], groups=h.shape[-1]))
        h = h + _conv(mixed, block["pointwise"])
    logp = jax.nn.log_softmax(jnp.mean(h, axis=(1, 2)) @ params["head"], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def convnet_batch(shape: ConvShape, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch, shape.size, shape.size, 3))
    labels = rng.integers(0, shape.classes, batch)
    return jnp.asarray(images, jnp.float32), jnp.asarray(labels, jnp.int32)


def cast(tree, dtype):
    """`tree` (parameters or a batch) with its floating-point arrays in `dtype` (token ids and
    labels as they are)."""
    floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)  # noqa: E731
    return jax.tree.map(lambda x: x.astype(dtype) if floating(x) else x, tree)


def parameter_count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
