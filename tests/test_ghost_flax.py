"""`clipped_grad` on Flax models (Linen and NNX): Dense, Embed (tied or not; learned positions,
looked up at ``jnp.arange(T)`` as GPT-2 does), LayerNorm, RMSNorm, attention, Conv (depthwise
too); ghost where the layer allows, and equal to the float64 reference (computed in bfloat16:
within its rounding of `method="vmap"`)."""

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


def linen_case(dtype=None):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(B, T)))
    model = LinenModel(dtype)
    params = model.init(jax.random.key(0), ids[:1])["params"]
    return lambda p, i: cross_entropy(model.apply({"params": p}, i), i), params, ids


def nnx_case():
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, size=(B, T)))
    graphdef, params = nnx.split(NNXModel(nnx.Rngs(0)), nnx.Param)
    params = nnx.to_pure_dict(params)

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
