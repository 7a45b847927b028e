"""The Optax transformations: the contract over dtypes, state, and composition with Optax."""

import copy
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import (
    as_f64,
    assert_close,
    random_leaves,
    ref_clip_by_average_norm,
    ref_clip_by_norm,
    ref_global_norm,
    ref_scale,
    run,
)

import optclip

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]


def _tree(dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    a, b, c = random_leaves(rng, [(3, 4), (4,), (2, 1)], np.float32)
    return {
        "w": jnp.asarray(a * scale, dtype),
        "b": jnp.asarray(b * scale, dtype),
        "s": jnp.asarray(c * scale, dtype),
    }


def _ref_value_clip(tree, v):
    return [np.clip(as_f64(x), -v, v) for x in jax.tree.leaves(tree)]


def _ref_norm_clip(tree, c, axes=None):
    return [ref_clip_by_norm(x, c, axes) for x in jax.tree.leaves(tree)]


def _ref_global_clip(tree, c):
    leaves = jax.tree.leaves(tree)
    scale = ref_scale(ref_global_norm(leaves), c)
    return [as_f64(x) * scale for x in leaves]


def _ref_block_rms_clip(tree, c):
    leaves = [as_f64(x) for x in jax.tree.leaves(tree)]
    return [x * ref_scale(np.sqrt(np.mean(np.abs(x) ** 2)), c) for x in leaves]


def _ref_sgd(reference):
    return lambda tree, c: [-0.1 * x for x in reference(tree, c)]


# (factory, float64 reference of the produced updates)
CONTRACT = {
    "value_clip": (lambda: optclip.value_clip(0.5), lambda t: _ref_value_clip(t, 0.5)),
    "norm_clip": (lambda: optclip.norm_clip(1.0), lambda t: _ref_norm_clip(t, 1.0)),
    "norm_clip_rows": (
        lambda: optclip.norm_clip(1.0, axes=-1),
        lambda t: _ref_norm_clip(t, 1.0, -1),
    ),
    "average_norm_clip": (
        lambda: optclip.average_norm_clip(0.1),
        lambda t: [ref_clip_by_average_norm(x, 0.1) for x in jax.tree.leaves(t)],
    ),
    "block_rms_clip": (lambda: optclip.block_rms_clip(0.5), lambda t: _ref_block_rms_clip(t, 0.5)),
    "global_clip": (lambda: optclip.global_clip(1.0), lambda t: _ref_global_clip(t, 1.0)),
    "global_clip_zero": (
        lambda: optclip.global_clip(1.0, nonfinite="zero"),
        lambda t: _ref_global_clip(t, 1.0),
    ),
    "clipped_clipnorm": (
        lambda: optclip.clipped(optax.sgd(0.1), clipnorm=1.0),
        lambda t: [-0.1 * x for x in _ref_norm_clip(t, 1.0)],
    ),
    "clipped_clipvalue": (
        lambda: optclip.clipped(optax.sgd(0.1), clipvalue=0.5),
        lambda t: [-0.1 * x for x in _ref_value_clip(t, 0.5)],
    ),
    "clipped_global": (
        lambda: optclip.clipped(optax.sgd(0.1), global_clipnorm=1.0, nonfinite="skip"),
        lambda t: [-0.1 * x for x in _ref_global_clip(t, 1.0)],
    ),
}


@pytest.mark.parametrize("name", CONTRACT)
@pytest.mark.parametrize("dtype", FLOATS)
def test_contract_every_transform_every_dtype(name, dtype, mode):
    make, reference = CONTRACT[name]
    tx = make()
    params = _tree(dtype, seed=1)
    updates = _tree(dtype, seed=2, scale=3.0)
    state = tx.init(params)
    new_updates, new_state = run(tx.update, mode)(updates, state, params)
    for out, x, exp in zip(
        jax.tree.leaves(new_updates), jax.tree.leaves(updates), reference(updates)
    ):
        assert out.dtype == x.dtype and out.shape == x.shape
        assert_close(out, exp, dtype, factor=2.0)
    # The state keeps its structure, shapes and dtypes from step to step.
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_global_clip_state_records_norm_and_counts():
    tx = optax.chain(optclip.global_clip(1.0), optax.adam(1e-3))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in ([3.0, 4.0], [0.3, 0.4], [np.inf, 0.0], [6.0, 8.0]):
        _, state = step({"w": jnp.array(g)}, state, params)
    assert float(optax.tree.get(state, "global_norm")) == 10.0
    assert int(optax.tree.get(state, "clip_count")) == 2
    assert int(optax.tree.get(state, "nonfinite_count")) == 1
    assert int(state[0].step) == 4


def test_global_clip_propagates_nan_by_default_and_zero_policy():
    bad = {"a": jnp.array([1.0, np.nan]), "b": jnp.ones(2, jnp.bfloat16)}
    tx = optclip.global_clip(1.0)
    out, state = tx.update(bad, tx.init(bad))
    assert all(np.all(np.isnan(as_f64(x))) for x in jax.tree.leaves(out))
    tx = optclip.global_clip(1.0, nonfinite="zero")
    out, state = jax.jit(tx.update)(bad, tx.init(bad))
    assert all(np.all(as_f64(x) == 0) for x in jax.tree.leaves(out))
    assert out["b"].dtype == jnp.bfloat16
    assert int(state.nonfinite_count) == 1 and int(state.clip_count) == 0


@pytest.mark.parametrize("policy", ["skip", "zero", "propagate"])
@pytest.mark.parametrize(
    "mode_kw", [{"global_clipnorm": 1.0}, {"clipnorm": 1.0}, {"clipvalue": 1.0}, {}]
)
def test_clipped_nonfinite_policies(policy, mode_kw):
    opt = optclip.clipped(optax.adam(0.1), nonfinite=policy, **mode_kw)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    step = jax.jit(opt.update)
    _, state = step({"w": jnp.array([0.5, -0.5, 2.0])}, state, params)
    before = state
    updates, state = step({"w": jnp.array([np.nan, 1.0, 1.0])}, state, params)
    inner_after = jax.tree.leaves(state.inner_state)
    inner_before = jax.tree.leaves(before.inner_state)
    if policy == "skip":
        assert np.all(np.asarray(updates["w"]) == 0)
        for a, b in zip(inner_after, inner_before):  # bit for bit: a true skipped step
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        assert int(state.skip_count) == 1
    elif policy == "zero":
        assert np.all(np.isfinite(np.asarray(updates["w"])))
        assert int(optax.tree.get(state.inner_state, "count")) == 2  # the optimizer did step
        assert int(state.skip_count) == 1
    else:
        assert np.any(np.isnan(np.asarray(updates["w"])))
        assert int(state.skip_count) == 0
    # A finite step afterwards is applied normally.
    updates, _ = step({"w": jnp.array([0.1, 0.1, 0.1])}, state, params)
    if policy != "propagate":
        assert np.all(np.isfinite(np.asarray(updates["w"]))) and np.any(updates["w"] != 0)


def test_clipped_matches_keras_semantics():
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, 12.0])}
    params = jax.tree.map(jnp.zeros_like, g)
    for kwargs, expected in (
        ({"clipnorm": 1.0}, {"a": [0.6, 0.8], "b": [0.0, 1.0]}),
        ({"clipvalue": 1.0}, {"a": [1.0, 1.0], "b": [0.0, 1.0]}),
        ({"global_clipnorm": 1.0}, {"a": [3 / 13, 4 / 13], "b": [0.0, 12 / 13]}),
        ({}, {"a": [3.0, 4.0], "b": [0.0, 12.0]}),
    ):
        opt = optclip.clipped(optax.sgd(1.0), **kwargs)
        updates, _ = opt.update(g, opt.init(params), params)
        for k in g:
            np.testing.assert_allclose(-np.asarray(updates[k]), expected[k], rtol=1e-6)


def test_inject_hyperparams_changes_threshold_without_retracing():
    traces = []
    for factory, kwargs in (
        (optclip.global_clip, {"max_norm": 1.0}),
        (optclip.norm_clip, {"max_norm": 1.0}),
        (optclip.average_norm_clip, {"max_norm": 0.5}),
        (optclip.value_clip, {"clip_value_min": 1.0}),
    ):
        opt = optax.inject_hyperparams(factory)(**kwargs)
        params = jnp.zeros(2)
        state = opt.init(params)

        def update(u, s, opt=opt, params=params):
            traces.append(1)
            return opt.update(u, s, params)

        step = jax.jit(update)
        first, state = step(jnp.array([3.0, 4.0]), state)
        name = next(iter(kwargs))
        state.hyperparams[name] = jnp.asarray(state.hyperparams[name] * 2)
        second, state = step(jnp.array([3.0, 4.0]), state)
        assert float(jnp.linalg.norm(second)) > float(jnp.linalg.norm(first))
    assert len(traces) == 4  # one trace per transform


@pytest.mark.parametrize("ord", [2, 1, float("inf"), 3.0])
def test_inject_hyperparams_with_a_numeric_ord(ord):
    opt = optax.inject_hyperparams(optclip.global_clip)(max_norm=1.0, ord=ord)
    x = jnp.array([3.0, -4.0])
    state = opt.init(x)
    updates, state = jax.jit(opt.update)(x, state)
    norm = ref_global_norm([x], float(ord))
    np.testing.assert_allclose(updates, np.array([3.0, -4.0]) / norm, rtol=1e-6)
    np.testing.assert_allclose(float(optax.tree.get(state, "global_norm")), norm, rtol=1e-6)


def test_schedule_thresholds():
    schedule = optax.linear_schedule(1.0, 3.0, transition_steps=2)
    x = jnp.array([30.0, 40.0])
    for tx in (
        optclip.global_clip(schedule),
        optclip.norm_clip(schedule),
        optclip.average_norm_clip(lambda count: schedule(count) / 2),
    ):
        state = tx.init(x)
        step = jax.jit(tx.update)
        norms = []
        for _ in range(4):
            out, state = step(x, state)
            norms.append(float(jnp.linalg.norm(out)))
        np.testing.assert_allclose(norms, [1.0, 2.0, 3.0, 3.0], rtol=1e-6)


def test_a_schedule_that_does_not_return_a_scalar_is_an_error():
    def bad(count):
        return jnp.ones(2) * count

    x = jnp.array([3.0, 4.0])
    for tx in (
        optclip.global_clip(bad),
        optclip.norm_clip(bad),
        optclip.average_norm_clip(bad),
        optclip.zclip(max_norm=bad),
    ):
        with pytest.raises(
            ValueError,
            match=r"`max_norm\(count\)` must be a scalar, got an array "
            r"of shape \(2,\)",
        ):
            tx.update(x, tx.init(x))


def test_composes_with_masked_and_multi_transform():
    params = {"w": jnp.zeros(2), "b": jnp.zeros(2)}
    grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([30.0, 40.0])}
    tx = optax.masked(optclip.global_clip(1.0), {"w": True, "b": False})
    out, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(out["b"], grads["b"])
    tx = optax.multi_transform(
        {"clip": optclip.global_clip(1.0), "keep": optax.identity()}, {"w": "clip", "b": "keep"}
    )
    out, state = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(out["w"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(out["b"], grads["b"])
    assert float(optax.tree.get(state, "global_norm")) == 5.0


def test_training_loop_in_lax_scan_and_grad_through_the_update():
    opt = optax.chain(optclip.global_clip(0.5), optax.sgd(0.1))
    target = jnp.array([10.0, -10.0])

    def loss(p):
        return jnp.sum((p - target) ** 2)

    def train(p0):
        def body(carry, _):
            p, s = carry
            g = jax.grad(loss)(p)
            u, s = opt.update(g, s, p)
            return (optax.apply_updates(p, u), s), optax.tree.get(s, "global_norm")

        (p, s), norms = jax.lax.scan(body, (p0, opt.init(p0)), length=20)
        return p, s, norms

    p, state, norms = jax.jit(train)(jnp.zeros(2))
    assert norms.shape == (20,) and int(state[0].clip_count) == 20
    np.testing.assert_allclose(p, [0.05 * 20 / np.sqrt(2), -0.05 * 20 / np.sqrt(2)], rtol=1e-5)
    # Meta-gradient through the whole loop (and through zero gradients) is finite.
    meta = jax.grad(lambda p0: jnp.sum(train(p0)[0]))(jnp.zeros(2))
    assert np.all(np.isfinite(np.asarray(meta)))
    # Zero gradients all along: the clip is the identity, so each SGD step multiplies the
    # deviation from the target by 1 - 0.1 * 2.
    meta = jax.grad(lambda p0: jnp.sum(train(p0)[0]))(target)
    np.testing.assert_allclose(meta, [0.8**20, 0.8**20], rtol=1e-5)


# block_rms_clip -------------------------------------------------------------------------------


def test_block_rms_clip_schedule_and_inject_hyperparams():
    x = {"w": jnp.full((2, 2), 3.0), "b": jnp.array([0.1, -0.1])}
    schedule = optax.linear_schedule(1.0, 2.0, transition_steps=1)
    tx = optclip.block_rms_clip(schedule)
    state = tx.init(x)
    step = jax.jit(tx.update)
    for expected in (1.0, 2.0, 2.0):
        out, state = step(x, state)
        np.testing.assert_allclose(out["w"], np.full((2, 2), expected), rtol=1e-6)
        np.testing.assert_array_equal(out["b"], x["b"])  # under the threshold: unchanged
    opt = optax.inject_hyperparams(optclip.block_rms_clip)(threshold=1.0)
    state = opt.init(x)
    out, state = jax.jit(opt.update)(x, state)
    np.testing.assert_allclose(out["w"], np.ones((2, 2)), rtol=1e-6)
    state.hyperparams["threshold"] = jnp.asarray(0.5)
    out, _ = jax.jit(opt.update)(x, state)
    np.testing.assert_allclose(out["w"], np.full((2, 2), 0.5), rtol=1e-6)


def test_block_rms_clip_agrees_with_optax_in_a_chain():
    params = _tree(jnp.float32, seed=3)
    grads = _tree(jnp.float32, seed=4, scale=3.0)
    ours = optax.chain(optclip.block_rms_clip(0.3), optax.adam(1e-2))
    theirs = optax.chain(optax.clip_by_block_rms(0.3), optax.adam(1e-2))
    a, _ = jax.jit(ours.update)(grads, ours.init(params), params)
    b, _ = jax.jit(theirs.update)(grads, theirs.init(params), params)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5)


# Open bounds in value_clip --------------------------------------------------------------------


def test_value_clip_open_bounds(mode):
    tree = {"f": jnp.array([-3.0, 0.5, 2.0]), "i": jnp.array([-5, 1, 9], jnp.int32)}

    def apply(tx):
        return run(tx.update, mode)(tree, tx.init(tree))[0]

    upper = apply(optclip.value_clip(None, 1.0))
    np.testing.assert_array_equal(upper["f"], [-3.0, 0.5, 1.0])
    np.testing.assert_array_equal(upper["i"], [-5, 1, 1])
    for lower in (
        apply(optclip.value_clip(0.0, None)),  # an explicit None is an open bound
        apply(optclip.value_clip(0.0, clip_value_max=None)),
        apply(optclip.value_clip(0.0, float("inf"))),  # (an infinite bound too)
    ):
        np.testing.assert_array_equal(lower["f"], [0.0, 0.5, 2.0])
        np.testing.assert_array_equal(lower["i"], [0, 1, 9])
        assert lower["i"].dtype == jnp.int32
    symmetric = apply(optclip.value_clip(1.0))  # only the one-argument form is [-v, v]
    np.testing.assert_array_equal(symmetric["f"], [-1.0, 0.5, 1.0])
    np.testing.assert_array_equal(symmetric["i"], [-1, 1, 1])
    for nothing in (apply(optclip.value_clip(None)), apply(optclip.value_clip(None, None))):
        for key in tree:
            np.testing.assert_array_equal(nothing[key], tree[key])


def test_value_clip_ports_optax_tree_clip_unchanged():
    """`optax.tree.clip(t, lo, hi)` and `clip_by_value(t, lo, hi)` mean the same bounds as the
    transformation with the same two arguments: None is an open bound in all three."""
    tree = {"a": jnp.array([-3.0, 0.5, 2.0, 5.0])}
    for lo, hi in ((2.0, None), (None, 0.5), (-1.0, 1.0), (None, None)):
        tx = optclip.value_clip(lo, hi)
        got = tx.update(tree, tx.init(tree))[0]
        np.testing.assert_array_equal(got["a"], optax.tree.clip(tree, lo, hi)["a"])
        np.testing.assert_array_equal(got["a"], optclip.clip_by_value(tree, lo, hi)["a"])


def test_value_clip_under_inject_hyperparams_keeps_the_one_argument_form():
    opt = optax.inject_hyperparams(optclip.value_clip)(1.0)
    g = jnp.array([-3.0, 0.5, 2.0])
    np.testing.assert_array_equal(jax.jit(opt.update)(g, opt.init(g))[0], [-1.0, 0.5, 1.0])
    opt = optax.inject_hyperparams(optclip.value_clip)(0.0, None)
    np.testing.assert_array_equal(jax.jit(opt.update)(g, opt.init(g))[0], [0.0, 0.5, 2.0])
    # The "not given" default survives a copy (wrappers that deep-copy their arguments).
    default = inspect.signature(optclip.value_clip).parameters["clip_value_max"].default
    tx = optclip.value_clip(1.0, copy.deepcopy(default))
    np.testing.assert_array_equal(tx.update(g, tx.init(g))[0], [-1.0, 0.5, 1.0])


# NaN thresholds -------------------------------------------------------------------------------

NAN_TRANSFORMS = {
    "global_clip": lambda c: optclip.global_clip(c),
    "norm_clip": lambda c: optclip.norm_clip(c),
    "average_norm_clip": lambda c: optclip.average_norm_clip(c),
    "block_rms_clip": lambda c: optclip.block_rms_clip(c),
    "value_clip": lambda c: optclip.value_clip(c),
    "clipped_clipnorm": lambda c: optclip.clipped(optax.sgd(1.0), clipnorm=c),
    "clipped_clipvalue": lambda c: optclip.clipped(optax.sgd(1.0), clipvalue=c),
    "clipped_global": lambda c: optclip.clipped(optax.sgd(1.0), global_clipnorm=c),
}


@pytest.mark.parametrize("name", NAN_TRANSFORMS)
def test_traced_nan_threshold_makes_the_update_nan(name):
    updates = {"a": jnp.array([0.3, 0.4]), "b": jnp.zeros(2, jnp.bfloat16)}
    opt = optax.inject_hyperparams(NAN_TRANSFORMS[name])(c=1.0)
    state = opt.init(updates)
    state.hyperparams["c"] = jnp.asarray(np.nan)
    out, _ = jax.jit(opt.update)(updates, state, updates)
    for leaf in jax.tree.leaves(out):
        assert np.all(np.isnan(as_f64(leaf)))  # never a silent "no clip"


@pytest.mark.parametrize(
    "factory", [optclip.norm_clip, optclip.global_clip, optclip.block_rms_clip]
)
def test_schedule_with_a_nan_value(factory):
    def schedule(count):
        return jnp.where(count < 1, 1.0, jnp.nan)

    x = jnp.array([3.0, 4.0])
    tx = factory(schedule)
    state = tx.init(x)
    out, state = tx.update(x, state)  # step 0: a number
    name = "threshold" if factory is optclip.block_rms_clip else "max_norm"
    with pytest.raises(ValueError, match=rf"`{name}\(count\)` must not be NaN, got"):
        tx.update(x, state)  # step 1, eager: the value is known, so it is an error
    out, _ = jax.jit(tx.update)(x, state)  # under jit it is traced: NaN updates
    assert np.all(np.isnan(np.asarray(out)))


# clipped: Keras' `<= 0` means off ---------------------------------------------------------------

KERAS_ARGS = ["clipnorm", "clipvalue", "global_clipnorm"]


@pytest.mark.parametrize("arg", KERAS_ARGS)
@pytest.mark.parametrize("value", [0, np.float32(-0.5)])
def test_clipped_non_positive_threshold_turns_the_clip_off(arg, value, mode):
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.0, -12.0], jnp.bfloat16)}
    opt = optclip.clipped(optax.sgd(1.0), **{arg: value})
    updates, _ = run(opt.update, mode)(g, opt.init(g), g)
    for out, x in zip(jax.tree.leaves(updates), jax.tree.leaves(g)):
        assert out.dtype == x.dtype
        np.testing.assert_array_equal(as_f64(out), -as_f64(x))  # plain SGD, nothing clipped


@pytest.mark.parametrize("arg", KERAS_ARGS)
def test_clipped_non_positive_traced_or_scheduled_threshold_turns_the_clip_off(arg):
    g = jnp.array([3.0, 4.0])
    clip = {"clipnorm": [0.6, 0.8], "clipvalue": [1.0, 1.0], "global_clipnorm": [0.6, 0.8]}[arg]

    @jax.jit
    def step(c):
        opt = optclip.clipped(optax.sgd(1.0), **{arg: c})
        return opt.update(g, opt.init(g), g)[0]

    np.testing.assert_array_equal(step(0.0), [-3.0, -4.0])
    np.testing.assert_array_equal(step(-2.0), [-3.0, -4.0])
    np.testing.assert_allclose(step(1.0), -np.array(clip), rtol=1e-6)
    opt = optax.inject_hyperparams(optclip.clipped)(optax.sgd(1.0), **{arg: 1.0})
    state = opt.init(g)
    state.hyperparams[arg] = jnp.asarray(0.0)
    np.testing.assert_array_equal(jax.jit(opt.update)(g, state, g)[0], [-3.0, -4.0])
    if arg != "clipvalue":  # clipvalue takes no schedule, as value_clip
        opt = optclip.clipped(optax.sgd(1.0), **{arg: lambda count: jnp.where(count < 1, 0, 1.0)})
        state = opt.init(g)
        first, state = jax.jit(opt.update)(g, state, g)
        second, _ = jax.jit(opt.update)(g, state, g)
        np.testing.assert_array_equal(first, [-3.0, -4.0])
        np.testing.assert_allclose(second, -np.array(clip), rtol=1e-6)


def test_transforms_keep_tensorflow_semantics_for_a_zero_threshold(mode):
    g = jnp.array([3.0, 4.0])
    with pytest.warns(UserWarning, match="zeroes every update"):  # (the warning: test_checks)
        norm_clip, global_clip = optclip.norm_clip(0.0), optclip.global_clip(-1.0)
    for tx in (norm_clip, global_clip, optclip.value_clip(0.0)):
        np.testing.assert_array_equal(run(tx.update, mode)(g, tx.init(g))[0], [0.0, 0.0])
