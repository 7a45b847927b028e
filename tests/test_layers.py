"""Stacked layers (``stacked=``): per-layer norms of scanned models against the float64 norms of
the same model unrolled, from the same reduction, in every clip that keeps group norms, with Flax
Linen and NNX models. (Several devices: ``tests/_workers/multidevice.py``, group "layers".)"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import ref_global_norm, run

import optclip
from optclip.norms import _groups, _layers

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]
LAYERS = 4


def stacked_model(dtype=jnp.float32, layers=LAYERS, rng=None):
    """A scanned model's gradients: the blocks' weights stacked along axis 0 under "blocks" (one
    leaf big enough to be reduced alone, two small ones of one shape stacked together, a bias,
    one value per layer), each layer at its own scale; leaves outside the stack."""
    rng = rng or np.random.default_rng(0)
    per_layer = 4.0 ** np.arange(layers)

    def leaf(*shape, stacked=True):
        x = rng.standard_normal((layers, *shape) if stacked else shape)
        if stacked:
            x = x * per_layer.reshape((layers,) + (1,) * len(shape))
        return jnp.asarray(x, dtype)

    return {
        "embed": leaf(40, 8, stacked=False),
        "blocks": {
            "attn": {"k": leaf(8, 8), "q": leaf(8, 8)},
            "mlp": {"b": leaf(8), "w": leaf(8, 2100)},  # w: > STACK_MAX_SIZE elements
            "scale": leaf(),
        },
        "head": {"b": leaf(8, stacked=False), "w": leaf(8, 8, stacked=False)},
    }


def unroll(tree, key="blocks", axis=0):
    """The same model unrolled: the stacked subtree `key` as a list of layers."""
    layers = jax.tree.leaves(tree[key])[0].shape[axis]
    out = dict(tree)
    out[key] = [
        jax.tree.map(lambda x, i=i: np.take(np.asarray(x), i, axis), tree[key])
        for i in range(layers)
    ]
    return out


def by_block(path):
    """A function spec: one group per block, the embedding alone, the head in no group."""
    first = _layers.key_text(path[0])
    return None if first == "head" else _groups.path_name(path[:2] if first == "blocks" else path)


def per_layer(path):
    """ "layer" on the unrolled model: a group per layer of blocks, every other leaf alone."""
    return _groups.path_name(path[:2] if _layers.key_text(path[0]) == "blocks" else path)


SPECS = {"layer": "layer", "leaf": "leaf", "depth2": 2, "depth1": 1, "function": by_block}
UNROLLED = {"layer": per_layer}


def expected(tree, spec, p=2.0):
    """``{group: float64 norm}`` of `tree`'s leaves (unrolled, no `stacked`), in order."""
    names, buckets = _groups.assign(spec, tree)
    leaves = jax.tree.leaves(tree)
    return {
        n: ref_global_norm([x for x, b in zip(leaves, buckets) if b == i], p)
        for i, n in enumerate(names)
    }


def check_groups(field, want, rtol=1e-6):
    assert list(field) == list(want)
    got = np.asarray(field.values, np.float64)
    np.testing.assert_allclose(got, list(want.values()), rtol=rtol)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_per_layer_norms_are_the_unrolled_models_group_norms(spec, dtype, mode):
    grads = stacked_model(dtype)
    tx = optclip.global_clip(1.0, stacked="blocks", group_norms=SPECS[spec])
    _, state = run(tx.update, mode)(grads, tx.init(grads))
    check_groups(state.group_norms, expected(unroll(grads), UNROLLED.get(spec, SPECS[spec])))
    assert state.group_norms.layers == (("blocks", LAYERS),)
    np.testing.assert_allclose(
        float(state.global_norm), ref_global_norm(jax.tree.leaves(grads)), rtol=1e-6
    )


def test_group_names_read_as_the_unrolled_model():
    grads = stacked_model()
    stacked = _groups.check_stacked("blocks")
    names = _groups.assign("layer", grads, stacked)[0]
    assert names == ("blocks/0", "blocks/1", "blocks/2", "blocks/3", "embed", "head/b", "head/w")
    leaf = _groups.assign("leaf", grads, stacked)[0]
    assert leaf[:6] == (
        "blocks/0/attn/k",
        "blocks/0/attn/q",
        "blocks/0/mlp/b",
        "blocks/0/mlp/w",
        "blocks/0/scale",
        "blocks/1/attn/k",
    )
    assert leaf == _groups.assign("leaf", unroll(grads))[0]
    assert _groups.assign(1, grads, stacked)[0] == ("blocks", "embed", "head")
    # A function sees layer i's path: the stack's keys, then the index, then the rest.
    seen = []
    _groups.assign(lambda path: seen.append(_groups.path_name(path)), grads, stacked)
    assert "blocks/2/mlp/w" in seen and "head/w" in seen


@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
@pytest.mark.parametrize("dtype", FLOATS)
def test_global_norm_and_update_bit_for_bit_the_same_whatever_the_groups(dtype, mode):
    """Given `stacked`, the groups only bucket the same partial sums: the global norm and the
    update are the same bits with no groups, per layer, per leaf or per block."""
    grads = stacked_model(dtype)
    outs = []
    for spec in (None, "layer", "leaf", 1):
        tx = optclip.global_clip(1.0, stacked="blocks", group_norms=spec)
        outs.append(run(tx.update, mode)(grads, tx.init(grads)))
    for updates, state in outs[1:]:
        assert np.array_equal(state.global_norm, outs[0][1].global_norm)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(outs[0][0])):
            assert np.array_equal(a, b)
    # Without `stacked`, the stacked leaves' partial sums are added in another order: the same
    # norm to float32 rounding, not necessarily the same bits.
    plain = optclip.global_clip(1.0)
    _, state = run(plain.update, mode)(grads, plain.init(grads))
    np.testing.assert_allclose(state.global_norm, outs[0][1].global_norm, rtol=1e-6)


@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
def test_bit_for_bit_on_the_overflow_path_too(mode):
    grads = stacked_model()
    grads["blocks"]["attn"]["q"] = grads["blocks"]["attn"]["q"].at[2, 0, 0].set(3e20)
    grads["blocks"]["mlp"]["b"] = grads["blocks"]["mlp"]["b"].at[1].set(2e-25)
    outs = []
    for spec in (None, "layer", "leaf"):
        tx = optclip.global_clip(1.0, stacked="blocks", group_norms=spec)
        outs.append(run(tx.update, mode)(grads, tx.init(grads)))
    for updates, state in outs[1:]:
        assert np.array_equal(state.global_norm, outs[0][1].global_norm)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(outs[0][0])):
            assert np.array_equal(a, b)
    want = expected(unroll(grads), per_layer)
    check_groups(outs[1][1].group_norms, want)
    assert math.isclose(want["blocks/2"], 3e20, rel_tol=1e-6)


@pytest.mark.parametrize("ord", [1.0, 3.0, 0.5, math.inf])
def test_per_layer_norms_for_every_order(ord, mode):
    grads = stacked_model()
    tx = optclip.global_clip(1.0, ord=ord, stacked="blocks", group_norms="layer")
    _, state = run(tx.update, mode)(grads, tx.init(grads))
    check_groups(state.group_norms, expected(unroll(grads), per_layer, ord), rtol=2e-6)


def test_per_layer_norms_with_a_traced_order_under_inject_hyperparams():
    grads = stacked_model()
    inject = optax.inject_hyperparams(optclip.global_clip, static_args=("group_norms",))
    tx = inject(max_norm=1.0, ord=1.0, group_norms="layer", stacked="blocks")
    _, state = jax.jit(tx.update)(grads, tx.init(grads))
    check_groups(state.inner_state.group_norms, expected(unroll(grads), per_layer, 1.0))


def test_a_layer_axis_other_than_the_first(mode):
    """MaxText's `param_scan_axis=1`: the layers along axis 1 of every leaf of the stack."""
    rng = np.random.default_rng(1)
    layers = {
        "query": jnp.asarray(rng.standard_normal((8, LAYERS, 2, 4)), jnp.float32),
        "norm": jnp.asarray(rng.standard_normal((8, LAYERS)), jnp.float32),
    }
    final_norm = jnp.asarray(rng.standard_normal(8), jnp.float32)
    grads = {"decoder": {"layers": layers, "final_norm": final_norm}}
    unrolled = {"decoder": {"final_norm": final_norm, **unroll({"layers": layers}, "layers", 1)}}
    tx = optclip.global_clip(1.0, stacked={"decoder/layers": 1}, group_norms="layer")
    _, state = run(tx.update, mode)(grads, tx.init(grads))
    want = expected(unrolled, lambda p: _groups.path_name(p[:3] if len(p) > 2 else p))
    assert list(want)[:2] == ["decoder/final_norm", "decoder/layers/0"]
    check_groups(state.group_norms, want)


def test_a_negative_layer_axis_counts_from_each_leafs_last_axis():
    f32 = np.float32
    grads = {"blocks": {"w": np.ones((3, LAYERS, 2), f32), "b": np.ones((LAYERS, 2), f32)}}
    tx = optclip.global_clip(1.0, stacked={"blocks": -2}, group_norms="layer")
    _, state = jax.jit(lambda g: tx.update(g, tx.init(g)))(grads)  # (one program)
    np.testing.assert_allclose(state.group_norms.values, [np.sqrt(8.0)] * LAYERS, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Every clip that keeps group norms; AGC's units.


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: optclip.autoclip(50.0, 10, **kw),
        lambda **kw: optclip.zclip(warmup_steps=2, **kw),
        lambda **kw: optclip.agc(0.1, **kw),
    ],
    ids=["autoclip", "zclip", "agc"],
)
def test_adaptive_clips_keep_per_layer_norms(make, mode):
    grads = stacked_model()
    params = jax.tree.map(lambda g: np.ones(g.shape, g.dtype), grads)
    clips = [make(stacked="blocks", group_norms=spec) for spec in ("layer", None)]

    def both(grads, states, params):  # (under `jit`: one program, not two)
        return [tx.update(grads, state, params) for tx, state in zip(clips, states)]

    outs = run(both, mode)(grads, [tx.init(params) for tx in clips], params)
    check_groups(outs[0][1].group_norms, expected(unroll(grads), per_layer))
    assert np.array_equal(outs[0][1].global_norm, outs[1][1].global_norm)
    for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0])):
        assert np.array_equal(a, b)


def test_agc_units_of_stacked_leaves_are_the_unrolled_models():
    """Declared stacked, a (layers, in, out) kernel's units are each layer's columns, as in the
    unrolled model; undeclared, AGC's rule for 3-d leaves (multi-head) mixes the layers."""
    rng = np.random.default_rng(2)
    params = {"blocks": {"w": jnp.asarray(rng.standard_normal((LAYERS, 6, 3)), jnp.float32)}}
    grads = {"blocks": {"w": jnp.asarray(rng.standard_normal((LAYERS, 6, 3)), jnp.float32)}}
    tx = optclip.agc(0.05, stacked="blocks")
    plain = optclip.agc(0.05)

    @jax.jit  # (one program for the three updates)
    def updates(grads, params, unrolled_grads, unrolled_params):
        return (
            tx.update(grads, tx.init(params), params)[0],
            plain.update(unrolled_grads, plain.init(unrolled_params), unrolled_params)[0],
            plain.update(grads, plain.init(params), params)[0],
        )

    stacked, unrolled, mixed = updates(grads, params, unroll(grads), unroll(params))
    want = np.stack([layer["w"] for layer in unrolled["blocks"]])
    np.testing.assert_allclose(stacked["blocks"]["w"], want, rtol=1e-6)
    assert not np.allclose(mixed["blocks"]["w"], want)


# ----------------------------------------------------------------------------------------------
# Flax: Linen's nn.scan, NNX's vmap/scan.


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(4)(nn.LayerNorm()(x)), None


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
        )
        x, _ = scan(name="blocks")(x, None)
        return nn.Dense(2, name="head")(x)


def test_flax_linen_scanned_model():
    model = LinenModel()
    x = np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4)
    # The model's shapes, traced (not run op by op), with NumPy draws for values.
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    rng = np.random.default_rng(3)
    variables = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
    grad_shapes = jax.eval_shape(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)), variables)
    grads = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), grad_shapes)
    kernel = grads["params"]["blocks"]["Dense_0"]["kernel"]
    assert kernel.shape == (LAYERS, 4, 4)
    # Key paths may leave out the lone "params".
    clips = [
        optclip.global_clip(1.0, stacked=stacked, group_norms="layer")
        for stacked in ("blocks", "params/blocks")
    ]
    states = jax.jit(lambda g, v: [tx.update(g, tx.init(v))[1] for tx in clips])(grads, variables)
    for state in states:
        names = [f"params/blocks/{i}" for i in range(LAYERS)] + [
            "params/head/bias",
            "params/head/kernel",
        ]
        assert list(state.group_norms) == names
        layer2 = jax.tree.map(lambda a: a[2], grads["params"]["blocks"])
        np.testing.assert_allclose(
            float(state.group_norms["params/blocks/2"]),
            ref_global_norm(jax.tree.leaves(layer2)),
            rtol=1e-6,
        )
    # Integer depths count the keys under a lone "params": depth 1 is the top-level modules.
    for tree, prefix in ((variables, "params/"), (variables["params"], "")):
        assert _groups.assign(1, tree)[0] == (f"{prefix}blocks", f"{prefix}head")
        stacked = _groups.check_stacked("blocks")
        assert _groups.assign(2, tree, stacked)[0][:2] == (f"{prefix}blocks/0", f"{prefix}blocks/1")


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return x + self.linear(self.norm(x))


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def test_flax_nnx_vmapped_blocks_in_an_nnx_optimizer():
    """The groups of the parameters given to `init` (NNX Variables) and of the gradients given
    to `update` agree, and `optclip.metrics` names each layer."""
    clip = optclip.global_clip(1.0, stacked="blocks", group_norms="layer")

    @nnx.jit  # (one program, not the vmapped blocks' and the optimizer's operations one by one)
    def create():
        model = NNXModel(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.chain(clip, optax.sgd(0.1)), wrt=nnx.Param)

    model, optimizer = create()
    x = np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4)

    @nnx.jit
    def step(model, optimizer):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return grads

    grads = nnx.to_pure_dict(step(model, optimizer))
    logged = optclip.metrics(optimizer.opt_state)
    groups = [k.removeprefix("global_clip/group_norm/") for k in logged if "/group_norm/" in k]
    assert groups == [f"blocks/{i}" for i in range(LAYERS)] + ["head/bias", "head/kernel"]
    for i in range(LAYERS):
        layer = jax.tree.leaves(jax.tree.map(lambda a, i=i: a[i], grads["blocks"]))
        np.testing.assert_allclose(
            float(logged[f"global_clip/group_norm/blocks/{i}"]), ref_global_norm(layer), rtol=1e-6
        )


# ----------------------------------------------------------------------------------------------
# Transformations: vmap, scan, grad, inject_hyperparams.


def test_vmap_gives_per_example_per_layer_norms():
    grads = stacked_model()
    del grads["blocks"]["mlp"]["w"]  # (small leaves: quicker to compile)
    grads = jax.tree.map(np.asarray, grads)  # (NumPy: the batch is made on the host)
    batch = jax.tree.map(lambda g: np.stack([g, 2 * g, g * np.float32(1e19)]), grads)
    tx = optclip.global_clip(1.0, stacked="blocks", group_norms="layer")
    states = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[1]))(batch)
    want = np.asarray(list(expected(unroll(grads), per_layer).values()))
    for k, factor in enumerate([1.0, 2.0, 1e19]):
        np.testing.assert_allclose(states.group_norms.values[k], factor * want, rtol=1e-6)


def test_state_is_fixed_shape_in_a_scan_and_stacked_is_static_under_inject_hyperparams():
    grads = stacked_model()
    inject = optax.inject_hyperparams(optclip.global_clip, static_args=("group_norms",))
    tx = optax.chain(
        inject(max_norm=1.0, stacked={"blocks": 0}, group_norms="layer"), optax.sgd(0.1)
    )
    state = tx.init(grads)

    def step(state, scale):
        _, state = tx.update(jax.tree.map(lambda g: g * scale, grads), state, grads)
        return state, state[0].inner_state.group_norms["blocks/3"]

    final, norms = jax.lax.scan(step, state, jnp.array([1.0, 2.0]))
    assert jax.tree.structure(final) == jax.tree.structure(state)
    want = expected(unroll(grads), per_layer)["blocks/3"]
    np.testing.assert_allclose(np.asarray(norms), [want, 2 * want], rtol=1e-6)


@pytest.mark.slow  # differentiating a clip of 8 leaves with per-layer groups compiles for ~10 s
def test_gradient_through_the_clip_is_the_same_with_per_layer_groups():
    grads = stacked_model()
    del grads["blocks"]["mlp"]["w"]

    def loss(tx, g):
        updates, _ = tx.update(g, tx.init(g))
        return sum(jnp.sum(jnp.sin(u)) for u in jax.tree.leaves(updates))

    plain = jax.grad(lambda g: loss(optclip.global_clip(1.0, stacked="blocks"), g))(grads)
    clip = optclip.global_clip(1.0, stacked="blocks", group_norms="layer")
    grouped = jax.grad(lambda g: loss(clip, g))(grads)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(grouped)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)
        assert np.all(np.isfinite(b))


# ----------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "stacked, error, pattern",
    [
        (3, TypeError, r"`stacked` must be None, the key path of a subtree of stacked layers"),
        ("", ValueError, r"got the key path '' in ''"),
        ([], ValueError, r"got an empty list"),
        (["blocks", 0], ValueError, r"got the key path 0 in \['blocks', 0\]"),
        (
            {"blocks": 0.5},
            TypeError,
            r"`stacked`'s layer axis for 'blocks' must be an int, got 0.5",
        ),
        ({"blocks": True}, TypeError, r"must be an int, got True"),
    ],
)
def test_bad_stacked_is_an_error_at_construction(stacked, error, pattern):
    with pytest.raises(error, match=pattern):
        optclip.global_clip(1.0, stacked=stacked)


def test_layer_groups_need_stacked():
    with pytest.raises(ValueError, match=r'`group_norms="layer"` makes one group per layer'):
        optclip.zclip(group_norms="layer")


# `stacked=` that does not fit the tree: the same error at `init` and at `update`, whatever
# `group_norms` is (the docstring's promise), eager and under `jit`.
NOT_FITTING = {
    "no such key path": (
        "nope",
        {"blocks": jnp.ones((2, 3)), "head": jnp.ones(3)},
        r"`stacked` names 'nope', which is no key path of this tree's leaves \(its "
        r"top-level keys: \['blocks', 'head'\]\)",
    ),
    "no layer axis 2": (
        {"blocks": 2},
        {"blocks": {"w": jnp.ones((2, 3))}},
        r"`stacked` gives leaf `blocks/w` \(shape \(2, 3\)\) layer axis 2, which it does not",
    ),
    "a 0-d leaf": (
        "blocks",
        {"blocks": {"b": jnp.ones(()), "w": jnp.ones((2, 3))}},
        r"`stacked` gives leaf `blocks/b` \(shape \(\)\) layer axis 0",
    ),
    "4 and 3 layers": (
        "blocks",
        {"blocks": {"v": jnp.ones((3, 2)), "w": jnp.ones((4, 2))}, "head": jnp.ones(2)},
        r"The leaves of stack 'blocks' of `stacked` must hold one number of layers: "
        r"`blocks/v` has 3, `blocks/w` 4",
    ),
    "two stacks": (
        ["blocks", "blocks/attn"],
        {"blocks": {"attn": jnp.ones((2, 3))}},
        r"Leaf `blocks/attn` is in two stacks of `stacked`: 'blocks' and 'blocks/attn'",
    ),
}
CLIPS_WITH_STACKED = {
    "global_clip": lambda **kw: optclip.global_clip(1.0, **kw),
    "agc": lambda **kw: optclip.agc(**kw),
    "autoclip": lambda **kw: optclip.autoclip(history=4, **kw),
    "zclip": lambda **kw: optclip.zclip(**kw),
}
GROUP_SPECS = {"None": None, "leaf": "leaf", "layer": "layer", "1": 1, "function": by_block}


@pytest.mark.every_case  # (each raises while tracing: nothing is compiled)
@pytest.mark.parametrize("case", NOT_FITTING)
@pytest.mark.parametrize(
    "clip, spec",
    [("global_clip", spec) for spec in GROUP_SPECS]
    + [
        (clip, spec)
        for clip in CLIPS_WITH_STACKED
        if clip != "global_clip"
        for spec in ("None", "layer")
    ],
)
def test_stacked_that_does_not_fit_the_tree_is_an_error_at_init_and_update(clip, spec, case):
    stacked, tree, pattern = NOT_FITTING[case]
    make = CLIPS_WITH_STACKED[clip]
    tx = make(stacked=stacked, group_norms=GROUP_SPECS[spec])
    # A state for `update` made without `stacked` (none with it can be made for this tree):
    # the updates' stacks are checked before the state's groups are.
    unstacked = make(group_norms="leaf" if spec == "layer" else GROUP_SPECS[spec])

    def init(tree):
        return tx.init(tree)

    def update(tree):
        return tx.update(tree, unstacked.init(tree), tree)

    for step in (init, update):
        for fn in (step, jax.jit(step)):
            with pytest.raises(ValueError, match=pattern):
                fn(tree)


def test_updates_with_another_number_of_layers_than_the_state_are_an_error():
    tx = optclip.global_clip(1.0, stacked="blocks", group_norms="layer")
    state = tx.init({"blocks": jnp.ones((3, 2))})
    with pytest.raises(
        ValueError, match=r"groups only in the state: \['blocks/2'\]; only in the updates: \[\]"
    ):
        tx.update({"blocks": jnp.ones((2, 2))}, state)
