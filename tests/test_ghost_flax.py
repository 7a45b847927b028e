"""`clipped_grad` on Flax models (Linen and NNX): Dense, Embed (tied or not; learned positions,
looked up at ``jnp.arange(T)`` as GPT-2 does), LayerNorm, RMSNorm, attention, Conv (depthwise
too); blocks stacked by `nn.scan` / `nnx.vmap` and `nnx.scan`, rematerialised or not;
GroupNorm, ConvTranspose, LoRALinear, DenseGeneral, Einsum; ghost where the layer allows, and
equal to the float64 reference (computed in bfloat16: within its rounding of
`method="vmap"`)."""

from typing import Any

import ghost_models as gm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import optclip

VOCAB, D, T, B = 11, 8, 5, 4


class LinenModel(linen.Module):
    dtype: Any = None  # what the layers compute in (their parameters stay float32)

    @linen.compact
    def __call__(self, ids):
        dt = self.dtype
        embed = linen.Embed(VOCAB, D, dtype=dt)
        h = embed(ids) + linen.Embed(T, D, dtype=dt, name="positions")(jnp.arange(ids.shape[-1]))
        h = linen.LayerNorm(dtype=dt)(h)
        h = h + linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=D, dtype=dt)(h)
        h = linen.RMSNorm(dtype=dt)(h)
        h = h + linen.Conv(D, (3,), padding="CAUSAL", dtype=dt)(h)  # over the sequence
        h = jax.nn.gelu(linen.Dense(D, dtype=dt)(h))
        return embed.attend(h)  # tied output projection


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.positions = nnx.Embed(T, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        # (depthwise over the sequence: a group per feature, as ConvNeXt's and MobileNet's)
        self.mix = nnx.Conv(D, D, (3,), feature_group_count=D, padding="CAUSAL", rngs=rngs)
        self.dense = nnx.Linear(D, D, rngs=rngs)
        self.out = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids) + self.positions(jnp.arange(ids.shape[-1]))
        h = self.norm(h)
        return self.out(jax.nn.relu(self.dense(h + self.mix(h))))


def cross_entropy(logits, ids):
    logits = logits.astype(jnp.float32)
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(ids, VOCAB))


def drawn(shapes, seed):
    """Parameters of these shapes (`jax.eval_shape`'s) drawn by NumPy, where Flax's
    initialisers would compile a program per shape: weights about ``1/sqrt(fan-in)``, norm
    scales about one and biases about zero (not exactly, as Flax's are)."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        x = rng.normal(size=leaf.shape)
        if len(leaf.shape) > 1:
            x = x / np.sqrt(np.prod(leaf.shape[:-1]))
        else:
            x = (1.0 if "scale" in jax.tree_util.keystr(path) else 0.0) + 0.1 * x
        return jnp.asarray(x, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def linen_params(model, x, seed):
    return drawn(jax.eval_shape(model.init, jax.random.key(0), x[:1])["params"], seed)


def nnx_split(make, seed):
    """The graph of the NNX module `make` builds (built abstractly) and its parameters (a pure
    dict, `drawn`)."""
    graphdef, shapes = nnx.split(nnx.eval_shape(make), nnx.Param)
    return graphdef, drawn(nnx.to_pure_dict(shapes), seed)


def linen_case(dtype=None):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(B, T)))
    model = LinenModel(dtype)
    params = linen_params(model, ids, 0)
    return lambda p, i: cross_entropy(model.apply({"params": p}, i), i), params, ids


def nnx_case():
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, size=(B, T)))
    graphdef, params = nnx_split(lambda: NNXModel(nnx.Rngs(0)), 1)

    def loss(p, i):
        state = nnx.State(p) if hasattr(nnx, "State") else p
        model = nnx.merge(graphdef, state)
        return cross_entropy(model(i), i)

    return loss, params, ids


@pytest.mark.parametrize("case", [nnx_case, linen_case])
def test_flax_models_match_the_reference_and_go_ghost(case):
    loss, params, ids = case()
    report = optclip.ghost_report(loss, params, ids)
    modes = {path: r.mode for path, r in report.items()}
    kernels = [p for p in modes if "kernel" in p or "embedding" in p]
    assert kernels and all(modes[p] == "ghost" for p in kernels), str(report)
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    grads, aux = jax.jit(g)(params, ids)
    norms, sums = gm.reference(loss, params, ids, 1.0)
    np.testing.assert_allclose(aux.grad_norms, norms, rtol=1e-5)
    # Relative to the whole sum (attention's key bias has a zero gradient, up to rounding).
    scale = max(np.max(np.abs(e)) for e in jax.tree.leaves(sums))
    for a, e in zip(jax.tree.leaves(grads), jax.tree.leaves(sums), strict=True):
        np.testing.assert_allclose(a, e, atol=1e-5 * scale)


@pytest.mark.slow  # (a Linen transformer in bfloat16: the slowest of the module's compiles)
@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_model_computed_in_bfloat16_goes_ghost(mode):
    """The Linen model computed in bfloat16 with float32 parameters (``dtype=jnp.bfloat16``,
    mixed precision as large models train): every kernel ghost; norms and sums within
    bfloat16's rounding of `method="vmap"`'s. Its attention's clipped sums could not run on a
    CPU before (a bfloat16 product to float32 whose weight has several output features, the
    heads: "Unsupported element type for DotThunk::Execute")."""
    loss, params, ids = linen_case(jnp.bfloat16)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    modes = {path: r.mode for path, r in optclip.ghost_report(loss, params, ids).items()}
    kernels = [p for p in modes if "kernel" in p or "embedding" in p]
    assert len(kernels) == 8 and all(modes[p] == "ghost" for p in kernels), modes
    key_bias = "['MultiHeadDotProductAttention_0']['key']['bias']"  # (softmax ignores a shift)
    gm.assert_as_vmap_to_bfloat16_rounding(loss, params, ids, 1.0, mode, noise=[key_bias])


# Stacked blocks, as large models are written: Linen's `nn.scan` (optionally over `nn.remat`),
# and NNX's blocks made by `nnx.vmap` and applied by `nnx.scan` (optionally through
# `nnx.remat`), each block a pre-norm attention layer (causal `MultiHeadDotProductAttention` /
# `MultiHeadAttention`) and an MLP.
LAYERS = 3


class LinenBlock(linen.Module):
    @linen.compact
    def __call__(self, h, _):
        mask = linen.make_causal_mask(jnp.ones(h.shape[:-1]))
        h = h + linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)(
            linen.LayerNorm()(h), mask=mask
        )
        return h + linen.Dense(D)(jax.nn.gelu(linen.Dense(2 * D)(linen.RMSNorm()(h)))), None


class LinenStacked(linen.Module):
    remat: bool

    @linen.compact
    def __call__(self, ids):
        embed = linen.Embed(VOCAB, D)
        block = linen.remat(LinenBlock, prevent_cse=False) if self.remat else LinenBlock
        scan = linen.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )
        h, _ = scan(name="blocks")(embed(ids), None)
        return embed.attend(linen.LayerNorm()(h))


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=D, qkv_features=D, decode=False, rngs=rngs
        )
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, h):
        mask = nnx.make_causal_mask(jnp.ones(h.shape[:-1]))
        h = h + self.attention(self.norm(h), mask=mask)
        return h + self.down(jax.nn.gelu(self.up(h)))


class NNXStacked(nnx.Module):
    def __init__(self, rngs, remat):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXBlock(rngs)

        self.remat = remat
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.blocks = make(rngs)
        self.out = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, ids):
        def forward(h, block):
            return block(h)

        if self.remat:
            forward = nnx.remat(forward)
        forward = nnx.scan(forward, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        # (NNX's Embed returns its `param_dtype`, float32, even from the float64 reference's
        # table: the blocks' carry takes the table's dtype.)
        h = self.embed(ids).astype(self.embed.embedding[...].dtype)
        return self.out(forward(h, self.blocks))


def linen_stacked(remat):
    ids = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, size=(B, T)))
    model = LinenStacked(remat)
    params = linen_params(model, ids, 2)
    return lambda p, i: cross_entropy(model.apply({"params": p}, i), i), params, ids


def nnx_stacked(remat):
    ids = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, size=(B, T)))
    graphdef, params = nnx_split(lambda: NNXStacked(nnx.Rngs(0), remat), 3)

    def loss(p, i):
        return cross_entropy(nnx.merge(graphdef, nnx.State(p))(i), i)

    return loss, params, ids


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "scan"])
@pytest.mark.parametrize("case", [nnx_stacked, linen_stacked])
def test_scanned_and_rematerialised_flax_blocks_go_ghost(case, remat, mode):
    """Every kernel and the (tied, for Linen) embedding of stacked Flax blocks goes ghost
    through the scan, and through the remat where there is one; each block's biases and norm
    scales are formed per example; norms and sums equal the float64 reference."""
    loss, params, ids = case(remat)
    program = str(jax.make_jaxpr(loss)(params, ids[:1]))
    assert "scan[" in program and ("remat" in program) == remat  # the model is as it says
    report = optclip.ghost_report(loss, params, ids)
    modes = {path: r.mode for path, r in report.items()}
    weights = [p for p in modes if "kernel" in p or "embedding" in p]
    assert len(weights) == (7 if case is linen_stacked else 8), modes  # 6 in each block
    assert all(modes[p] == "ghost" for p in weights), str(report)
    others = [p for p in modes if p not in weights]  # biases and norm scales
    assert others and all(modes[p] == "materialised" for p in others), str(report)
    stacked = jax.tree.leaves(params["blocks"])
    assert stacked and all(a.shape[0] == LAYERS for a in stacked)
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    grads, aux = (jax.jit(g) if mode == "jit" else g)(params, ids)
    norms, sums = gm.reference(loss, params, ids, 1.0)
    assert np.all(norms > 1.0)  # every example clipped
    np.testing.assert_allclose(aux.grad_norms, norms, rtol=1e-5)
    gm.assert_tree_close(grads, sums, whole=True)


# More of the layers Flax users write: convolutions with GroupNorm (the norm DP-SGD image
# models use), a transposed convolution, a LoRA adapter; DenseGeneral over two axes, Einsum.
class NNXImageModel(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.norm = nnx.GroupNorm(8, num_groups=4, rngs=rngs)
        self.down = nnx.Conv(8, 8, (3, 3), strides=2, padding="VALID", rngs=rngs)
        self.up = nnx.ConvTranspose(8, 4, (3, 3), strides=(2, 2), rngs=rngs)
        self.head = nnx.LoRALinear(4, 10, lora_rank=2, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.norm(self.conv(x)))
        h = jnp.tanh(self.up(nnx.relu(self.down(h))))
        return self.head(h.mean(axis=(1, 2)))


class LinenGeneralModel(linen.Module):
    @linen.compact
    def __call__(self, x):
        h = jnp.tanh(linen.DenseGeneral((2, 3), axis=-1)(x))  # features into (heads, 3)
        h = linen.DenseGeneral(D, axis=(-2, -1))(h)  # and back, contracting both
        return linen.Einsum((D, 10), "btd,de->bte")(jax.nn.gelu(h)).mean(axis=1)


def labelled(logits, labels):
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, 10))


def nnx_image_case():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(B, 9, 9, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, size=B))
    # (`drawn` draws LoRA's second factor too, where Flax's starts at zero, which would leave
    # its first one no gradient.)
    graphdef, params = nnx_split(lambda: NNXImageModel(nnx.Rngs(0)), 4)

    def loss(p, x, y):
        return labelled(nnx.merge(graphdef, nnx.State(p))(x), y)

    return loss, params, (x, labels), 6  # kernels: 2 convolutions, 1 transposed, 3 of LoRA


def linen_general_case():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, size=B))
    model = LinenGeneralModel()
    params = linen_params(model, x, 5)
    return lambda p, x, y: labelled(model.apply({"params": p}, x), y), params, (x, labels), 3


@pytest.mark.parametrize("case", [nnx_image_case, linen_general_case])
def test_more_flax_layers_go_ghost(case, mode):
    """Every kernel of these layers goes ghost (LoRA's base weight and its two factors each a
    dense layer), their biases and GroupNorm's scale and bias are formed per
    example, and the norms and sums equal the float64 reference."""
    loss, params, (x, labels), count = case()
    report = optclip.ghost_report(loss, params, x, labels, batch_argnums=(1, 2))
    modes = {path: r.mode for path, r in report.items()}
    kernels = [p for p in modes if "kernel" in p or "lora_" in p]
    assert len(kernels) == count and all(modes[p] == "ghost" for p in kernels), str(report)
    others = [p for p in modes if p not in kernels]
    assert others and all(modes[p] == "materialised" for p in others), str(report)
    g = optclip.clipped_grad(loss, l2_clip_norm=0.5, batch_argnums=(1, 2), return_grad_norms=True)
    grads, aux = (jax.jit(g) if mode == "jit" else g)(params, x, labels)
    with jax.enable_x64(True):  # the reference, with the labels as a second batch argument
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)
        x64 = jnp.asarray(np.asarray(x, np.float64))
        per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))
        per = per_example(p64, x64[:, None], labels[:, None])
        per = jax.tree.map(np.asarray, per)
    norms = np.sqrt(sum(np.sum(g.reshape(B, -1) ** 2, axis=1) for g in jax.tree.leaves(per)))
    assert np.all(norms > 0.5)  # every example clipped
    np.testing.assert_allclose(aux.grad_norms, norms, rtol=1e-5)
    factors = 0.5 / norms
    gm.assert_tree_close(
        grads, jax.tree.map(lambda g: np.tensordot(factors, g, 1), per), whole=True
    )
