"""`clipped_grad` on Equinox models, written as Equinox users write them: `eqx.nn` layers act
on one example (the loss vmaps the model over the size-1 batch axis `keep_batch_dim` passes),
the parameters are split from the rest with `eqx.partition` and combined back in the loss;
Linear, MLP, Embedding tied by `eqx.nn.Shared`, LayerNorm, RMSNorm, MultiheadAttention,
Conv1d/Conv2d, identical blocks made with `eqx.filter_vmap` and applied with `lax.scan`, fields
that are not parameters, and `eqx.nn.Dropout` keyed per example. Norms and clipped sums equal
the float64 reference, eager and under `jit`, and the layers with a closed form go ghost."""

import functools
from collections.abc import Callable

import equinox as eqx
import ghost_models as gm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import run

import optclip

VOCAB, D, T, B = 11, 8, 5, 4


def drawn(make, seed):
    """The model `make` builds (from ``jax.random.key(seed)``, abstractly) with every floating
    leaf drawn by NumPy, where Equinox's initialisers would compile programs per shape: weights
    about ``1/sqrt(fan-in)``, norm scales about one, biases about zero, and noise of 0.3 on
    every leaf (norm scales not all ones, biases not all zeros). Its other array leaves stay
    abstract: the caller sets them."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if not (isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.inexact)):
            return leaf
        if len(leaf.shape) > 1:
            base = rng.uniform(-1, 1, leaf.shape) / np.sqrt(leaf.shape[-1])
        else:
            base = float(jax.tree_util.keystr(path).endswith("weight"))  # (a norm's scale)
        return jnp.asarray(base + 0.3 * rng.normal(size=leaf.shape), leaf.dtype)

    model = eqx.filter_eval_shape(make, jax.random.key(seed))
    return jax.tree_util.tree_map_with_path(draw, model)


def as_loss(model, loss_of_outputs, keep_batch_dim=True):
    """``loss(params, x)`` and the params: the model combined back from its parameters and
    static part, applied to the example (vmapped over its size-1 batch axis if
    `keep_batch_dim`)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, x):
        m = eqx.combine(p, static)
        return loss_of_outputs(jax.vmap(m)(x) if keep_batch_dim else m(x), x)

    return loss, params


def cross_entropy(logits, ids):
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(ids, VOCAB, dtype=logits.dtype))


def check(loss, params, x, clip=1.0, mode="jit", keep_batch_dim=True):
    """`clipped_grad`'s norms and clipped sum against the float64 reference (its loss jitted:
    one compiled call per example instead of op-by-op dispatch); returns the reference's
    norms."""
    g = optclip.clipped_grad(
        loss, l2_clip_norm=clip, return_grad_norms=True, keep_batch_dim=keep_batch_dim
    )
    grads, aux = run(g, mode)(params, x)
    one = loss if keep_batch_dim else (lambda p, x: loss(p, x[0]))
    norms, sums = gm.reference(jax.jit(one), params, x, clip)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=gm.RTOL)
    gm.assert_tree_close(grads, sums)
    return norms


def modes(report):
    return {path: r.mode for path, r in report.items()}


def expected_mode(path):
    """Biases and norm scales are elementwise uses (materialised, each only its own size per
    example); Linear, attention projection and Conv weights are ghost."""
    return "materialised" if path.endswith(".bias") or "norm" in path else "ghost"


# --- Models ------------------------------------------------------------------------------


class Transformer(eqx.Module):
    """Token ids ``(T,)`` through an Embedding whose table is also the output Linear's weight
    (`eqx.nn.Shared`), LayerNorm, causal MultiheadAttention, RMSNorm, a causal Conv1d over the
    sequence, an MLP."""

    shared: eqx.nn.Shared
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.RMSNorm
    conv: eqx.nn.Conv1d
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k = jax.random.split(key, 5)
        embed = eqx.nn.Embedding(VOCAB, D, key=k[0])
        out = eqx.nn.Linear(D, VOCAB, use_bias=False, key=k[1])
        self.shared = eqx.nn.Shared((embed, out), lambda p: p[1].weight, lambda p: p[0].weight)
        self.norm1 = eqx.nn.LayerNorm(D)
        self.attention = eqx.nn.MultiheadAttention(2, D, use_output_bias=True, key=k[2])
        self.norm2 = eqx.nn.RMSNorm(D)
        self.conv = eqx.nn.Conv1d(D, D, 3, padding=((2, 0),), key=k[3])
        self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, activation=jax.nn.gelu, key=k[4])

    def __call__(self, ids):
        embed, out = self.shared()
        h = jax.vmap(embed)(ids)
        a = jax.vmap(self.norm1)(h)
        h = h + self.attention(a, a, a, mask=jnp.tril(jnp.ones((T, T), bool)))
        h = h + self.conv(jax.vmap(self.norm2)(h).T).T
        h = h + jax.vmap(self.mlp)(h)
        return jax.vmap(out)(h)


class Block(eqx.Module):
    norm: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    activation: Callable = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.RMSNorm(D)
        self.up = eqx.nn.Linear(D, 2 * D, key=k1)
        self.down = eqx.nn.Linear(2 * D, D, use_bias=False, key=k2)
        self.activation = jax.nn.silu

    def __call__(self, x):
        return x + self.down(self.activation(self.up(self.norm(x))))


class Stack(eqx.Module):
    """A sequence ``(T, D)`` through identical blocks, made with `eqx.filter_vmap` and applied
    with `lax.scan` over their stacked parameters (`eqx.partition` / `eqx.combine` in the
    step), then a Linear head."""

    blocks: Block
    head: eqx.nn.Linear
    layers: int = eqx.field(static=True)

    def __init__(self, key, layers=3):
        k1, k2 = jax.random.split(key)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k1, layers))
        self.head = eqx.nn.Linear(D, 3, key=k2)
        self.layers = layers

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(h, d):
            return jax.vmap(eqx.combine(d, static))(h), None

        h, _ = jax.lax.scan(step, x, dynamic, length=self.layers)
        return jax.vmap(self.head)(h)


class ConvNet(eqx.Module):
    """An image ``(C, H, W)`` through Conv2d layers (strided and padded; dilated with "SAME"
    padding; depthwise), then a Linear head."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    depthwise: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(2, 4, 3, stride=(2, 1), padding=((1, 1), (0, 2)), key=k[0])
        self.conv2 = eqx.nn.Conv2d(4, 3, 2, padding="SAME", dilation=(2, 1), key=k[1])
        self.depthwise = eqx.nn.Conv2d(3, 3, 2, groups=3, use_bias=False, key=k[2])
        self.head = eqx.nn.Linear(3, 2, key=k[3])

    def __call__(self, x):
        h = jnp.tanh(self.conv2(jnp.tanh(self.conv1(x))))
        return self.head(jnp.mean(self.depthwise(h), axis=(1, 2)))


INDEX = (2, 0)


class Statics(eqx.Module):
    """Fields that are not parameters beside an MLP: an int, a float, a string, a callable, a
    tuple and an integer array (not differentiated: `eqx.partition` leaves each in the static
    part, and the loss closes over them)."""

    mlp: eqx.nn.MLP
    repeat: int
    temperature: float
    name: str
    activation: Callable
    outputs: tuple
    index: jax.Array

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(5, 3, 4, 2, activation=jnp.tanh, key=key)
        self.repeat = 2
        self.temperature = 0.5
        self.name = "statics"
        self.activation = jnp.sin
        self.outputs = (0, 2)
        self.index = jnp.array(INDEX, jnp.int32)

    def __call__(self, x):
        for _ in range(self.repeat):
            x = x.at[self.index].set(self.activation(x[self.index]))
        return self.mlp(x / self.temperature)[jnp.array(self.outputs)]


class Bag(eqx.Module):
    """Token ids ``(T,)``: their embeddings averaged, then a Linear head."""

    embed: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=k1)
        self.head = eqx.nn.Linear(D, 3, key=k2)

    def __call__(self, ids):
        return self.head(jnp.mean(jax.vmap(self.embed)(ids), axis=0))


class DropoutNet(eqx.Module):
    linear1: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    linear2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear1 = eqx.nn.Linear(5, 6, key=k1)
        self.dropout = eqx.nn.Dropout(0.5)
        self.linear2 = eqx.nn.Linear(6, 3, key=k2)

    def __call__(self, x, *, key):
        return self.linear2(self.dropout(jax.nn.relu(self.linear1(x)), key=key))


class Masked(eqx.Module):
    """Dropout by a given mask (the reference's: its masks are drawn in float32, as in the
    clipped function; under float64 `jax.random.bernoulli` would draw others)."""

    mask: jax.Array

    def __call__(self, x, *, key=None):
        return x * self.mask


# (Each model is built once: the tests that use it share it.)
@functools.cache
def transformer():
    model = drawn(Transformer, 0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, size=(B, T)))
    return (*as_loss(model, cross_entropy), ids)


@functools.cache
def stack():
    model = drawn(Stack, 1)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, D)), jnp.float32)
    return (*as_loss(model, lambda y, x: jnp.sum(jnp.sin(y))), x)


@functools.cache
def convnet():
    model = drawn(ConvNet, 2)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, 2, 7, 6)), jnp.float32)
    return (*as_loss(model, lambda y, x: jnp.sum(jnp.cos(y))), x)


@functools.cache
def bag():
    model = drawn(Bag, 5)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, size=(B, T)))
    return (*as_loss(model, lambda y, ids: jnp.sum(jnp.sin(y))), ids)


# Each model and a threshold that clips some of its examples and not others.
MODELS = {"transformer": (transformer, 60.0), "stack": (stack, 20.0), "conv": (convnet, 0.9)}


def jit_fast_eager_slow(names, slow=()):
    """Each name under `jit` (the fast tier, unless in `slow`) and eagerly (the slow tier)."""
    return [
        pytest.param(
            name, mode, marks=[pytest.mark.slow] if mode == "eager" or name in slow else []
        )
        for name in names
        for mode in ("jit", "eager")
    ]


# --- Tests -------------------------------------------------------------------------------


# Conv2d in the slow tier only (the fast tier has the Conv1d in the transformer).
@pytest.mark.every_case
@pytest.mark.parametrize("name, mode", jit_fast_eager_slow(MODELS, slow=("conv",)))
def test_equinox_models_match_the_reference_and_go_ghost(name, mode):
    make, clip = MODELS[name]
    loss, params, x = make()
    got = modes(optclip.ghost_report(loss, params, x))
    assert got and all(m != "unused" for m in got.values()), got
    expected = {path: expected_mode(path) for path in got}
    assert {path: got[path] for path in expected} == expected
    norms = check(loss, params, x, clip, mode)
    assert np.min(norms) < clip < np.max(norms)


@pytest.mark.every_case
@pytest.mark.parametrize("tied", [False, True])
def test_embedding_lookups_go_ghost(tied):
    # eqx.nn.Embedding's `weight[i]`, vmapped: a gather of (1, D) slices at (i, 0), no
    # collapsed dimension, then a squeeze (Flax's lookup gathers rows at (i,), collapsed).
    if tied:  # (its numbers are checked with the model's)
        loss, params, ids = transformer()
        path = ".shared.pytree[0].weight"
    else:
        loss, params, ids = bag()
        check(loss, params, ids)
        path = ".embed.weight"
    report = optclip.ghost_report(loss, params, ids)
    assert report[path].mode == "ghost", str(report)


def test_fields_that_are_not_parameters_stay_static(mode):
    # Without `keep_batch_dim` the loss is given one example as it is, and calls the model on
    # it directly (no vmap).
    model = eqx.tree_at(lambda m: m.index, drawn(Statics, 3), jnp.array(INDEX, jnp.int32))
    loss, params = as_loss(model, lambda y, x: jnp.sum(y**2), keep_batch_dim=False)
    assert (params.repeat, params.name, params.activation, params.index) == (None,) * 4
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, 5)), jnp.float32)
    report = optclip.ghost_report(loss, params, x, keep_batch_dim=False)
    assert modes(report) == {path: expected_mode(path) for path in report}
    check(loss, params, x, 1.0, mode, keep_batch_dim=False)


def test_dropout_keys_are_split_per_example(mode):
    # `prng_argnum`: the key is split into one per example (jax_privacy's rule), each
    # example's dropout drawing from its own.
    model = drawn(DropoutNet, 4)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, x, key):
        m = eqx.combine(p, static)
        return jnp.sum(jax.vmap(lambda xi: m(xi, key=key))(x) ** 2)

    x = jnp.asarray(np.random.default_rng(4).normal(size=(B, 5)), jnp.float32)
    key = jax.random.key(6)
    report = optclip.ghost_report(loss, params, x, key, prng_argnum=2)
    assert modes(report) == {path: expected_mode(path) for path in report}
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True, prng_argnum=2)

    def step(p, x, key):  # the clipped sums and each example's dropout mask, in one program
        masks = jax.vmap(lambda k: model.dropout(jnp.ones(6), key=k))(jax.random.split(key, B))
        return g(p, x, key), masks

    (grads, aux), masks = run(step, mode)(params, x, key)
    assert 0 < np.sum(masks == 0) < masks.size

    def masked(p, xm):  # one example and its mask, side by side
        m = eqx.tree_at(lambda m: m.dropout, eqx.combine(p, static), Masked(xm[0, 5:]))
        return jnp.sum(m(xm[0, :5], key=None) ** 2)

    norms, sums = gm.reference(jax.jit(masked), params, jnp.concatenate([x, masks], 1), 1.0)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=gm.RTOL)
    gm.assert_tree_close(grads, sums)
