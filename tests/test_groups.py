"""Per-group norms (`group_norms=`): against the float64 reference, from the same reduction as the
global norm, in every clip that keeps a norm."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import ref_global_norm, run

import optclip
from optclip.norms import _groups

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]


def model_grads(dtype, rng=None):
    """Gradient-like tree: small leaves of one shape in several layers (stacked together across
    groups), a leaf big enough to be reduced alone, a scalar, and very different scales."""
    rng = rng or np.random.default_rng(0)

    def leaf(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)

    return {
        "embed": leaf(130, 130, scale=0.01),  # > STACK_MAX_SIZE elements: reduced on its own
        "layers": [
            {"w": leaf(4, 4, scale=10.0**i), "b": leaf(4, scale=10.0**-i)} for i in range(3)
        ],
        "head": {"w": leaf(4, 4), "scale": leaf()},
    }


def expected(tree, spec, p=2.0):
    """``{group: norm}`` in float64, from the leaves each group holds."""
    names, buckets = _groups.assign(spec, tree)
    leaves = jax.tree.leaves(tree)
    return {
        n: ref_global_norm([x for x, b in zip(leaves, buckets) if b == i], p)
        for i, n in enumerate(names)
    }


def by_layer(path):
    """A function spec: one group per layer, the head in none."""
    return None if path[0].key == "head" else _groups.path_name(path[:2])


SPECS = {"leaf": "leaf", "depth1": 1, "depth2": 2, "function": by_layer}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_group_norms_match_the_reference(spec, dtype, mode):
    grads = model_grads(dtype)
    tx = optclip.global_clip(1.0, group_norms=SPECS[spec])
    _, state = run(tx.update, mode)(grads, tx.init(grads))
    want = expected(grads, SPECS[spec])
    assert list(state.group_norms) == list(want)
    assert state.group_norms.values.dtype == jnp.float32
    for name, norm in want.items():
        np.testing.assert_allclose(float(state.group_norms[name]), norm, rtol=1e-6)
    np.testing.assert_allclose(
        float(state.global_norm), ref_global_norm(jax.tree.leaves(grads)), rtol=1e-6
    )


def test_group_names():
    grads = model_grads(jnp.float32)
    # In JAX's leaf order (dict keys sorted).
    assert _groups.assign(1, grads)[0] == ("embed", "head", "layers")
    depth2 = ("embed", "head/scale", "head/w", "layers/0", "layers/1", "layers/2")
    assert _groups.assign(2, grads)[0] == depth2
    assert "layers/2/b" in _groups.assign("leaf", grads)[0]
    assert _groups.assign("leaf", jnp.ones(3))[0] == ("<array>",)
    names, buckets = _groups.assign(by_layer, grads)
    assert names == ("embed", "layers/0", "layers/1", "layers/2")
    assert buckets[1:3] == (4, 4)  # the head's two leaves: in no group (the bucket after them)


@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
def test_the_global_norm_and_update_are_bit_for_bit_the_same_with_groups(mode):
    grads = model_grads(jnp.float32)
    plain, grouped = optclip.global_clip(1.0), optclip.global_clip(1.0, group_norms="leaf")
    u1, s1 = run(plain.update, mode)(grads, plain.init(grads))
    u2, s2 = run(grouped.update, mode)(grads, grouped.init(grads))
    assert np.array_equal(s1.global_norm, s2.global_norm)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
        assert np.array_equal(a, b)


def test_groups_far_apart_in_scale(mode):
    """One layer overflows float32 squares and one underflows them: each group still gets its
    own norm (each bucket of the fallback has its own scale)."""
    grads = {
        "huge": jnp.array([1e20, -2e20], jnp.float32),
        "tiny": jnp.array([3e-25, 4e-25], jnp.float32),
        "normal": jnp.array([3.0, 4.0], jnp.float32),
    }
    tx = optclip.global_clip(1.0, group_norms="leaf")
    _, state = run(tx.update, mode)(grads, tx.init(grads))
    for name, norm in expected(grads, "leaf").items():
        np.testing.assert_allclose(float(state.group_norms[name]), norm, rtol=1e-6)
    np.testing.assert_allclose(float(state.global_norm), math.sqrt(5) * 1e20, rtol=1e-6)


def test_a_zero_group_is_zero_and_a_nonfinite_group_is_named(mode):
    grads = {"frozen": jnp.zeros(3), "ok": jnp.array([3.0, 4.0]), "bad": jnp.array([1.0, np.nan])}
    tx = optclip.global_clip(1.0, group_norms="leaf")
    _, state = run(tx.update, mode)(grads, tx.init(grads))
    assert float(state.group_norms["frozen"]) == 0.0
    assert float(state.group_norms["ok"]) == 5.0
    assert np.isnan(state.group_norms["bad"]) and np.isnan(state.global_norm)


@pytest.mark.parametrize("ord", [1.0, 3.0, 0.5, math.inf])
def test_group_norms_for_every_order(ord, mode):
    grads = model_grads(jnp.float32)
    tx = optclip.global_clip(1.0, ord=ord, group_norms=2)
    _, state = run(tx.update, mode)(grads, tx.init(grads))
    for name, norm in expected(grads, 2, ord).items():
        np.testing.assert_allclose(float(state.group_norms[name]), norm, rtol=2e-6)


def test_group_norms_with_a_traced_order_under_inject_hyperparams():
    grads = model_grads(jnp.float32)
    inject = optax.inject_hyperparams(optclip.global_clip, static_args=("group_norms",))
    tx = inject(max_norm=1.0, ord=1.0, group_norms=1)
    _, state = jax.jit(tx.update)(grads, tx.init(grads))
    inner = state.inner_state
    for name, norm in expected(grads, 1, 1.0).items():
        np.testing.assert_allclose(float(inner.group_norms[name]), norm, rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda g: optclip.autoclip(50.0, 10, group_norms=g),
        lambda g: optclip.zclip(warmup_steps=2, group_norms=g),
        lambda g: optclip.agc(0.1, group_norms=g),
    ],
    ids=["autoclip", "zclip", "agc"],
)
def test_adaptive_clips_keep_group_norms(make, mode):
    grads = model_grads(jnp.float32)
    params = jax.tree.map(lambda x: jnp.ones_like(x), grads)
    tx = make(1)
    _, state = run(tx.update, mode)(grads, tx.init(params), params)
    for name, norm in expected(grads, 1).items():
        np.testing.assert_allclose(float(state.group_norms[name]), norm, rtol=1e-6)
    assert make(None).init(params).group_norms is None


def test_state_structure_is_fixed_and_scan_safe():
    grads = model_grads(jnp.float32)
    tx = optax.chain(optclip.global_clip(1.0, group_norms="leaf"), optax.sgd(0.1))
    state = tx.init(grads)

    def step(state, scale):
        updates, state = tx.update(jax.tree.map(lambda g: g * scale, grads), state, grads)
        return state, state[0].group_norms["layers/2/w"]

    final, norms = jax.lax.scan(step, state, jnp.array([1.0, 2.0, 3.0]))
    assert jax.tree.structure(final) == jax.tree.structure(state)
    want = expected(grads, "leaf")["layers/2/w"]
    np.testing.assert_allclose(np.asarray(norms), [want, 2 * want, 3 * want], rtol=1e-6)


def test_vmap_gives_per_example_group_norms():
    grads = jax.tree.map(np.asarray, model_grads(jnp.float32))  # (the batch made on the host)
    batch = jax.tree.map(lambda g: np.stack([g, 2 * g, g * np.float32(1e19)]), grads)
    tx = optclip.global_clip(1.0, group_norms=1)
    states = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[1]))(batch)
    for k, factor in enumerate([1.0, 2.0, 1e19]):
        for i, norm in enumerate(expected(grads, 1).values()):
            np.testing.assert_allclose(
                float(states.group_norms.values[k, i]), factor * norm, rtol=1e-6
            )


@pytest.mark.slow  # differentiating a 9-leaf clip with groups compiles for ~10 s
def test_gradient_through_the_clip_is_the_same_with_groups():
    grads = model_grads(jnp.float32)
    del grads["embed"]  # (small leaves only: the point is the stacks shared by groups)

    def loss(tx, g):
        updates, _ = tx.update(g, tx.init(g))
        return sum(jnp.sum(jnp.sin(u)) for u in jax.tree.leaves(updates))

    plain = jax.grad(lambda g: loss(optclip.global_clip(1.0), g))(grads)
    grouped = jax.grad(lambda g: loss(optclip.global_clip(1.0, group_norms="leaf"), g))(grads)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(grouped)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)
        assert np.all(np.isfinite(b))


def reads_in_entry(text: str, shape: str) -> list:
    """For each array of type `shape` (e.g. ``f32[24,64,48]``) that the compiled program's entry
    computation takes or makes, how many of its instructions read it (tuples that only pass
    it on, to the overflow fallback's `conditional` or out, left aside)."""
    entry = text[text.index("ENTRY") :].splitlines()
    defined = re.compile(r"^\s*(?:ROOT )?(%\S+) = " + re.escape(shape) + r"\{")
    names = [m.group(1) for m in map(defined.match, entry) if m]
    consumers = [line.split("=", 1)[1] for line in entry if "=" in line and " tuple(" not in line]
    return [
        sum(len(re.findall(re.escape(name) + r"(?![\w.])", line)) for line in consumers)
        for name in names
    ]


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_group_norms_cost_no_second_pass_over_the_gradients():
    """The per-leaf norms come from the global norm's own partial sums: outside the rare
    overflow fallback, the compiled program reads each stack of leaves once, with groups as
    without (XLA would otherwise fuse a second reduction of the squares)."""
    leaves = {f"layer{i}": jax.ShapeDtypeStruct((100,), jnp.float32) for i in range(300)}

    def reads_of_the_stacks(spec):
        tx = optclip.global_clip(1.0, group_norms=spec)
        state = jax.eval_shape(tx.init, leaves)  # (shapes only: nothing run op by op)
        text = jax.jit(tx.update).lower(leaves, state).compile().as_text()
        return reads_in_entry(text, "f32[128,100]")

    assert reads_of_the_stacks("leaf") == reads_of_the_stacks(None) == [1, 1]


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_per_layer_norms_cost_no_second_pass_over_the_gradients():
    """A stacked leaf is reduced once, over every axis but its layer axis (one partial sum per
    layer): the compiled program reads it twice (its norm, then the scaling) with per-layer
    groups as without groups, and as without `stacked` (a reduction to one partial sum)."""
    f32 = jnp.float32
    grads = {
        "blocks": {k: jax.ShapeDtypeStruct((24, 64, 48), f32) for k in "abc"},
        "head": jax.ShapeDtypeStruct((64, 48), f32),
    }

    def reads_of_the_stacked_leaves(spec, stacked):
        tx = optclip.global_clip(1.0, group_norms=spec, stacked=stacked)
        state = jax.eval_shape(tx.init, grads)  # (shapes only: nothing run op by op)
        text = jax.jit(tx.update).lower(grads, state).compile().as_text()
        return reads_in_entry(text, "f32[24,64,48]")

    plain = reads_of_the_stacked_leaves(None, None)
    assert plain == [2, 2, 2, 0, 0, 0]  # the three leaves, then the three scaled updates
    assert reads_of_the_stacked_leaves("layer", "blocks") == plain
    assert reads_of_the_stacked_leaves("leaf", "blocks") == plain
    assert reads_of_the_stacked_leaves(None, "blocks") == plain


def test_group_norms_is_a_readable_checkpointable_pytree():
    norms = optclip.GroupNorms(("a", "b"), jnp.array([1.0, 2.0]))
    assert float(norms["b"]) == 2.0 and len(norms) == 2 and list(norms.keys()) == ["a", "b"]
    assert [(n, float(v)) for n, v in norms.items()] == [("a", 1.0), ("b", 2.0)]
    leaves, treedef = jax.tree.flatten(norms)
    assert len(leaves) == 1
    assert jax.tree.unflatten(treedef, leaves).names == ("a", "b")
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(norms)[0]]
    assert paths == [".values"]
    with pytest.raises(KeyError, match="No group named 'c'; the groups are 'a', 'b'"):
        norms["c"]


@pytest.mark.parametrize("bad", ["layers", 0, -1, True, 1.5, ["leaf"]])
def test_bad_group_norms_is_an_error_listing_the_accepted_values(bad):
    with pytest.raises(ValueError, match=r'`group_norms` must be None, "leaf" \(one group per'):
        optclip.global_clip(1.0, group_norms=bad)


def test_group_norms_under_inject_hyperparams_must_be_static():
    tx = optax.inject_hyperparams(optclip.global_clip)(max_norm=1.0, group_norms=1)
    with pytest.raises(TypeError, match=r"pass `static_args=\('group_norms',\)`"):
        tx.init({"w": jnp.ones(2)})


def test_a_group_function_must_return_a_name():
    tx = optclip.global_clip(1.0, group_norms=lambda path: len(path))
    with pytest.raises(
        TypeError,
        match=r"must return a group name \(a str\) or None; for leaf "
        r"`\['w'\]` it returned 1",
    ):
        tx.init({"w": jnp.ones(2)})


def test_updates_that_do_not_match_the_state_are_an_error():
    tx = optclip.global_clip(1.0, group_norms="leaf")
    state = tx.init({"w": jnp.ones(2)})
    with pytest.raises(
        ValueError,
        match=r"was made \(by `init`\) for other parameters than these "
        r"updates \(groups only in the state: \['w'\]",
    ):
        tx.update({"v": jnp.ones(2)}, state)
