"""Bad input: a clear error at the call, naming the argument or the leaf."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optclip


@pytest.mark.parametrize(
    "call",
    [
        lambda: optclip.clip_by_norm(jnp.ones(3), jnp.ones(2)),
        lambda: optclip.clip_by_average_norm(jnp.ones(3), np.ones((2,))),
        lambda: optclip.clip_by_global_norm([jnp.ones(3)], jnp.ones(2)),
    ],
)
def test_threshold_must_be_0d(call):
    message = r"`clip_norm` must be a scalar, got an array of shape \(2,\)"
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    "factory", [optclip.norm_clip, optclip.average_norm_clip, optclip.global_clip]
)
def test_transform_threshold_must_be_0d(factory):
    message = r"`max_norm` must be a scalar, got an array of shape \(3,\)"
    with pytest.raises(ValueError, match=message):
        factory(jnp.ones(3))
    with pytest.raises(TypeError, match="`max_norm` must be a real number"):
        factory("1.0")


def test_use_norm_must_be_0d():
    message = r"`use_norm` must be a scalar, got an array of shape \(1,\)"
    with pytest.raises(ValueError, match=message):
        optclip.clip_by_global_norm([jnp.ones(3)], 1.0, use_norm=jnp.ones(1))


@pytest.mark.parametrize(
    "call",
    [
        lambda t: optclip.global_norm(t),
        lambda t: optclip.clip_by_norm(t, 1.0),
        lambda t: optclip.clip_by_average_norm(t, 1.0),
        lambda t: optclip.clip_by_global_norm(t, 1.0),
        lambda t: optclip.global_clip(1.0).update(t, optclip.global_clip(1.0).init(t)),
        lambda t: optclip.norm_clip(1.0).update(t, optax.EmptyState()),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_norm_modes_reject_integer_and_bool_leaves(call, dtype):
    tree = {"layer": [jnp.ones(2), jnp.ones(2, dtype)]}
    with pytest.raises(TypeError, match=rf"leaf `\['layer'\]\[1\]` has dtype {jnp.dtype(dtype)}"):
        call(tree)


def test_clip_by_value_accepts_integers_but_not_bools():
    np.testing.assert_array_equal(optclip.clip_by_value(jnp.array([5, -5]), -2, 2), [2, -2])
    with pytest.raises(TypeError, match=r"leaf `\['m'\]` has dtype bool"):
        optclip.clip_by_value({"m": jnp.array([True])}, 0, 1)


def test_bounds_must_be_ordered():
    with pytest.raises(ValueError, match="`clip_value_min` must be <= `clip_value_max`"):
        optclip.clip_by_value(jnp.ones(2), 1.0, 0.0)
    with pytest.raises(ValueError, match="`clip_value_min` must be <= `clip_value_max`"):
        optclip.value_clip(1.0, -1.0)
    with pytest.raises(ValueError, match=r"means the range \[-v, v\] and must be >= 0"):
        optclip.value_clip(-1.0)


def test_bounds_must_broadcast_to_each_leaf():
    tree = {"a": jnp.ones((2, 3)), "b": jnp.ones((4,))}
    with pytest.raises(
        ValueError,
        match=r"`clip_value_max` of shape \(3,\) does not broadcast "
        r"to leaf `\['b'\]` of shape \(4,\)",
    ):
        optclip.clip_by_value(tree, 0.0, jnp.ones(3))


def test_axes_out_of_range_names_the_leaf():
    tree = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"`axes` \(1,\) is out of range for leaf `\['b'\]`"):
        optclip.clip_by_norm(tree, 1.0, axes=1)
    with pytest.raises(ValueError, match=r"out of range for leaf `\['b'\]`"):
        optclip.norm_clip(1.0, axes=-2).update(tree, optax.EmptyState())
    with pytest.raises(ValueError, match="repeats an axis"):
        optclip.clip_by_norm(jnp.ones((2, 2)), 1.0, axes=(0, -2))
    with pytest.raises(TypeError, match="`axes` must be None, an int or a sequence of ints"):
        optclip.norm_clip(1.0, axes="rows")


def test_clipped_takes_at_most_one_clip():
    with pytest.raises(
        ValueError,
        match="at most one of `clipnorm`, `clipvalue` and "
        "`global_clipnorm`, got `clipnorm`, `clipvalue`",
    ):
        optclip.clipped(optax.sgd(1.0), clipnorm=1.0, clipvalue=1.0)


def test_unknown_policy_or_order_lists_the_accepted_values():
    accepted = "`nonfinite` must be one of 'propagate', 'zero', 'raise'; got"
    with pytest.raises(ValueError, match=accepted):
        optclip.global_clip(1.0, nonfinite="skip")
    with pytest.raises(ValueError, match="'propagate', 'zero', 'skip', 'raise'; got 'ignore'"):
        optclip.clipped(optax.sgd(1.0), nonfinite="ignore")
    for bad in (0, -1, "fro", np.nan, True, [2]):
        with pytest.raises(ValueError, match=r"`ord` must be 1, 2, inf .* or any number p > 0"):
            optclip.global_norm(jnp.ones(2), ord=bad)
        with pytest.raises(ValueError, match="`ord` must be"):
            optclip.global_clip(1.0, ord=bad)


def test_axis_name_tree_that_does_not_match():
    from jax.sharding import PartitionSpec as P

    with pytest.raises(ValueError, match="`axis_name` .* does not match the updates"):
        optclip.global_norm({"a": jnp.ones(2), "b": jnp.ones(2)}, axis_name={"a": P("x")})


def test_traced_axes_under_inject_hyperparams_says_what_to_do():
    opt = optax.inject_hyperparams(optclip.norm_clip)(max_norm=1.0, axes=0)
    state = opt.init(jnp.ones((2, 2)))
    with pytest.raises(TypeError, match=r"static_args=\('axes',\)"):
        jax.jit(opt.update)(jnp.ones((2, 2)), state)
    opt = optax.inject_hyperparams(optclip.norm_clip, static_args=("axes",))(max_norm=1.0, axes=0)
    out, _ = jax.jit(opt.update)(jnp.full((2, 2), 3.0), opt.init(jnp.ones((2, 2))))
    np.testing.assert_allclose(out, np.full((2, 2), 2**-0.5), rtol=1e-6)


NAN = float("nan")

# (call with a NaN threshold, the argument the message must name)
NAN_THRESHOLDS = {
    "clip_by_norm": (lambda c: optclip.clip_by_norm(jnp.ones(2), c), "clip_norm"),
    "clip_by_average_norm": (lambda c: optclip.clip_by_average_norm(jnp.ones(2), c), "clip_norm"),
    "clip_by_block_rms": (lambda c: optclip.clip_by_block_rms(jnp.ones(2), c), "threshold"),
    "clip_by_global_norm": (lambda c: optclip.clip_by_global_norm(jnp.ones(2), c), "clip_norm"),
    "clip_by_value_min": (lambda c: optclip.clip_by_value(jnp.ones(2), c, 1.0), "clip_value_min"),
    "clip_by_value_max": (lambda c: optclip.clip_by_value(jnp.ones(2), None, c), "clip_value_max"),
    "norm_clip": (optclip.norm_clip, "max_norm"),
    "average_norm_clip": (optclip.average_norm_clip, "max_norm"),
    "block_rms_clip": (optclip.block_rms_clip, "threshold"),
    "global_clip": (optclip.global_clip, "max_norm"),
    "value_clip": (optclip.value_clip, "clip_value_min"),
    "value_clip_max": (lambda c: optclip.value_clip(None, c), "clip_value_max"),
    "zclip": (lambda c: optclip.zclip(max_norm=c), "max_norm"),
    "clipnorm": (lambda c: optclip.clipped(optax.sgd(1.0), clipnorm=c), "clipnorm"),
    "clipvalue": (lambda c: optclip.clipped(optax.sgd(1.0), clipvalue=c), "clipvalue"),
    "global_clipnorm": (
        lambda c: optclip.clipped(optax.sgd(1.0), global_clipnorm=c),
        "global_clipnorm",
    ),
}


@pytest.mark.parametrize("name", NAN_THRESHOLDS)
@pytest.mark.parametrize(
    "nan", [NAN, np.float32(NAN), jnp.array(NAN, jnp.bfloat16)], ids=["float", "np32", "bf16"]
)
def test_a_nan_threshold_is_an_error_naming_the_argument(name, nan):
    call, argument = NAN_THRESHOLDS[name]
    bound = argument.startswith("clip_value")
    accepted = "a bound is a number" if bound else "a threshold is a number"
    with pytest.raises(ValueError, match=rf"`{argument}` must not be NaN, got .*; {accepted}"):
        call(nan)


def test_a_nan_threshold_known_under_jit_is_an_error_too():
    with pytest.raises(ValueError, match="`clip_norm` must not be NaN, got nan"):
        jax.jit(lambda g: optclip.clip_by_norm(g, NAN))(jnp.ones(2))
    with pytest.raises(ValueError, match=r"`clip_value_max` must not be NaN, got Array\(\["):
        optclip.clip_by_value(jnp.ones(2), 0.0, jnp.array([1.0, NAN]))


def test_adaptive_thresholds_say_what_they_accept_for_nan():
    with pytest.raises(ValueError, match="`clipping` must be a number >= 0, got nan"):
        optclip.agc(clipping=NAN)
    with pytest.raises(ValueError, match="`z_thresh` must be a number > 0, got nan"):
        optclip.zclip(z_thresh=NAN)
    with pytest.raises(ValueError, match=r"`percentile` must be a number in \[0, 100\], got nan"):
        optclip.autoclip(percentile=NAN)


def test_bounds_must_be_numbers_arrays_or_none():
    with pytest.raises(TypeError, match="`clip_value_max` must be a real number, an array or None"):
        optclip.clip_by_value(jnp.ones(2), 0.0, "1")


@pytest.mark.parametrize(
    "optimizer, received",
    [
        (optax.adam, r"got the function `adam` \(call it first\)"),
        (optax.GradientTransformation, r"got the class `GradientTransformation`"),
        (None, "got NoneType: None"),
        ("adam", "got str: 'adam'"),
        (optax.adam(1e-3).init, r"got the function `init_fn` \(call it first\)"),
    ],
)
def test_clipped_needs_a_transformation_not_a_factory(optimizer, received):
    accepted = r"`optimizer` must be an optax.GradientTransformation such as `optax.adam\(1e-3\)`"
    with pytest.raises(TypeError, match=f"{accepted}; {received}"):
        optclip.clipped(optimizer, clipnorm=1.0)


# `axes`: one strict check for clip_by_norm, norm_clip and agc's `axis` -----------------------

BAD_AXES = [[0.5], ["1"], True, jnp.array(1.5), "rows", (0, 1.0), np.array([0.0])]


@pytest.mark.parametrize("axes", BAD_AXES, ids=[repr(a) for a in BAD_AXES])
def test_axes_are_ints_or_an_error_never_truncated(axes):
    message = r"`axes` must be None, an int or a sequence of ints, got "
    with pytest.raises(TypeError, match=message):
        optclip.clip_by_norm(jnp.ones((2, 2)), 1.0, axes=axes)
    with pytest.raises(TypeError, match=message):
        optclip.norm_clip(1.0, axes=axes)
    with pytest.raises(TypeError, match=r"`axis` must be None, an int or a sequence of ints"):
        optclip.agc(0.01, axis=axes)


def test_axes_accept_numpy_and_0d_integer_arrays():
    x = jnp.array([[3.0, 4.0], [0.3, 0.4]])
    want = optclip.clip_by_norm(x, 1.0, axes=[1])
    for axes in (1, np.int64(1), jnp.array(1), (jnp.array(-1),), np.array([1])):
        np.testing.assert_array_equal(optclip.clip_by_norm(x, 1.0, axes=axes), want)
        tx = optclip.norm_clip(1.0, axes=axes)
        np.testing.assert_array_equal(tx.update(x, tx.init(x))[0], want)


# Bounds: complex, and integers beyond int32 -----------------------------------------------


@pytest.mark.parametrize("bound", [1 + 2j, np.complex64(1 + 2j), jnp.array([1 + 2j, 3])])
def test_a_complex_bound_is_an_error_naming_it(bound):
    with pytest.raises(TypeError, match=r"`clip_value_max` must be (real|a real number)"):
        optclip.clip_by_value(jnp.ones(2), 0.0, bound)
    with pytest.raises(TypeError, match=r"`clip_value_min` must be (real|a real number)"):
        optclip.value_clip(bound, None)


def test_a_complex_array_bound_says_why():
    with pytest.raises(TypeError, match="a complex bound has no order .* got dtype complex64"):
        optclip.clip_by_value(jnp.ones(2), jnp.array(1j), None)


def test_bounds_beyond_int32_are_the_numbers_they_say():
    x = {"f": jnp.array([-3.0, 5e12]), "i": jnp.array([-3, 2**31 - 1], jnp.int32)}
    for big in (2**40, np.int64(2**40), np.array([2**40, 2**40])):
        out = optclip.clip_by_value(x, 0, big)
        np.testing.assert_array_equal(out["f"], np.float32([0.0, 2.0**40]))
        np.testing.assert_array_equal(out["i"], [0, 2**31 - 1])  # saturated: no bound
        assert out["i"].dtype == jnp.int32
        out = optclip.clip_by_value(x, -big, -1)
        np.testing.assert_array_equal(out["i"], [-3, -1])
    tx = optclip.value_clip(2**40)  # [-2**40, 2**40]: nothing to clip here
    np.testing.assert_array_equal(tx.update(x, tx.init(x))[0]["i"], x["i"])


def test_an_int_threshold_beyond_int32_is_a_big_number_not_an_overflow():
    x = {"w": jnp.array([3.0, 4.0])}
    for big in (2**40, np.int64(2**40)):  # (NumPy int64 would wrap to 0 in a JAX int32)
        np.testing.assert_array_equal(optclip.clip_by_norm(x, big)["w"], x["w"])
        clipped, norm = optclip.clip_by_global_norm(x, big)
        np.testing.assert_array_equal(clipped["w"], x["w"])
        for tx in (optclip.global_clip(big), optclip.norm_clip(big), optclip.zclip(max_norm=big)):
            updates, state = tx.update(x, tx.init(x))
            np.testing.assert_array_equal(updates["w"], x["w"])
        assert float(optax.tree.get(state, "threshold")) >= 2.0**40
        summed, _ = optclip.per_example_clip({"w": x["w"][None]}, big)
        np.testing.assert_array_equal(summed["w"], x["w"])


def test_an_int_too_large_for_any_float_is_an_error():
    with pytest.raises(ValueError, match="`clip_norm` is too large for any float dtype"):
        optclip.clip_by_global_norm(jnp.ones(2), 10**400)
    with pytest.raises(ValueError, match="`max_norm` is too large for any float dtype"):
        optclip.global_clip(10**400)
    with pytest.raises(ValueError, match="`clip_value_max` is too large for any float dtype"):
        optclip.clip_by_value(jnp.ones(2), None, 10**400)


# Leaves that are not numbers: one check at every entry point, naming the leaf -----------


def _transform(make, *, params=False):
    """An optax transformation's `init` and `update` as entry points: ``(init, update)``, each a
    function of ``(good tree, bad tree)``; `params`: `update` also reads the parameters (then
    a third entry point gives it the bad tree as `params`)."""

    def init(good, bad):
        return make().init(bad)

    def update(good, bad):
        tx = make()
        return tx.update(bad, tx.init(good), good)

    def update_params(good, bad):
        tx = make()
        return tx.update(good, tx.init(good), bad)

    init_what, update_what = "`init`", None
    cases = [("init", init, init_what), ("update", update, update_what)]
    return cases + ([("update(params=)", update_params, update_what)] if params else [])


def _function(call, what):
    return [("", lambda good, bad: call(bad), what)]


def _metrics(good, bad):
    state = optclip.global_clip(1.0).init(good)
    return optclip.metrics((optax.EmptyState(), state._replace(global_norm=bad["k"])))


_SCALED = optclip.DynamicLossScale(4.0)


def _ghost_loss(params, batch):
    return jnp.mean(batch["a"] @ params["a"].T) + jnp.mean(batch["k"] * params["k"][0, 0])


def _ghost(entry):
    """`clipped_grad`'s function and `ghost_report`: the bad leaf in the parameters (argument
    0) or in the batch (argument 1); each leaf named with its argument's place."""

    def params(good, bad):
        return entry(bad, jax.tree.map(lambda x: jnp.stack([x] * 2), good))

    def batch(good, bad):
        return entry(good, {"a": jnp.stack([good["a"]] * 2), "k": bad["k"]})

    return [("(params)", params, None), ("(batch)", batch, None)]


def _clipped_grad(p, b):
    return optclip.clipped_grad(_ghost_loss, l2_clip_norm=1.0)(p, b)


def _ghost_report(p, b):
    return optclip.ghost_report(_ghost_loss, p, b)


GHOST_CASES = _ghost(_clipped_grad) + _ghost(_ghost_report)
# Where the ghost entry points name the leaf: its argument's place, then its path.
LEAF_PATHS = {call: rf"\[{i % 2}\]\['k'\]" for i, (_, call, _) in enumerate(GHOST_CASES)}

# Every public name: how a tree with a leaf that is not a number reaches it (each case a
# function of a good tree and the same tree with the bad leaf at ``['k']``, and the start of the
# message, None for any), or why nothing reads leaves there. A new public name fails
# `test_every_public_name_is_in_the_leaf_table` until it is placed here.
LEAF_ENTRY_POINTS: dict = {
    "AGCState": "a state class",
    "AccumulationState": "a state class",
    "AuxiliaryOutput": "a result class (of `clipped_grad`)",
    "ClippedGradFn": "the function `clipped_grad` returns (run in its cases)",
    "GhostReport": "a result class (of `ghost_report`)",
    "LeafReport": "a result class (of `ghost_report`)",
    "clipped_grad": GHOST_CASES[:2],
    "ghost_report": GHOST_CASES[2:],
    "AdaGCState": "a state class",
    "AutoClipState": "a state class",
    "ClippedState": "a state class",
    "GlobalClipState": "a state class",
    "GroupNorms": "a state field's class",
    "GuardedState": "a state class",
    "LossScaleState": "a state class",
    "ScheduleState": "a state class",
    "SpikeState": "a state class",
    "ZClipState": "a state class",
    "DynamicLossScale": "settings of `guarded` (its cases run `guarded` with a loss scale)",
    "SpikeSkip": "settings of `guarded`",
    "AxisNameError": "an exception class",
    "NonFiniteNormError": "an exception class",
    "reraise_errors": "a context manager around a step: it reads no tree",
    "force_ghost_route": "a context manager around tracing `clipped_grad`: it reads no tree",
    "loss_scale": "reads one field of a `guarded` state (unchecked: docs/design/inputs.md)",
    "global_norm": _function(optclip.global_norm, "global_norm"),
    "clip_by_value": _function(lambda t: optclip.clip_by_value(t, 0.0, 1.0), "`clip_by_value`"),
    "clip_by_norm": _function(lambda t: optclip.clip_by_norm(t, 1.0), "clip_by_norm"),
    "clip_by_average_norm": _function(
        lambda t: optclip.clip_by_average_norm(t, 1.0), "clip_by_average_norm"
    ),
    "clip_by_block_rms": _function(
        lambda t: optclip.clip_by_block_rms(t, 1.0), "clip_by_block_rms"
    ),
    "clip_by_global_norm": _function(
        lambda t: optclip.clip_by_global_norm(t, 1.0), "clip_by_global_norm"
    ),
    "per_example_clip": _function(lambda t: optclip.per_example_clip(t, 1.0), "per_example_clip"),
    "per_example_layer_clip": _function(
        lambda t: optclip.per_example_layer_clip(t, 1.0), "per_example_layer_clip"
    ),
    "check_split": _function(lambda t: optclip.check_split(t, "i"), "`check_split`"),
    "metrics": [("", _metrics, "`metrics`")],
    "value_clip": _transform(lambda: optclip.value_clip(1.0)),
    "norm_clip": _transform(lambda: optclip.norm_clip(1.0))
    + _transform(lambda: optclip.norm_clip(optax.linear_schedule(2.0, 1.0, 4))),
    "average_norm_clip": _transform(lambda: optclip.average_norm_clip(1.0)),
    "block_rms_clip": _transform(lambda: optclip.block_rms_clip(1.0)),
    "global_clip": _transform(lambda: optclip.global_clip(1.0))
    + _transform(lambda: optclip.global_clip(1.0, group_norms="leaf", stacked="k"))
    # (`optax.inject_hyperparams`' own `init` reads the parameters' dtype before ours: its
    # `update` only)
    + _transform(lambda: optax.inject_hyperparams(optclip.global_clip)(max_norm=1.0))[1:],
    "clipped": _transform(lambda: optclip.clipped(optax.adam(1e-3)))
    + _transform(lambda: optclip.clipped(optax.sgd(0.1), clipnorm=1.0))
    + _transform(lambda: optclip.clipped(optax.sgd(0.1), clipvalue=1.0, nonfinite="skip"))
    + _transform(lambda: optclip.clipped(optax.adam(1e-3), global_clipnorm=1.0)),
    "guarded": _transform(lambda: optclip.guarded(optax.adam(1e-3)))
    + _transform(lambda: optclip.guarded(optax.sgd(0.1), clip=optclip.norm_clip(1.0)))
    + _transform(
        lambda: optclip.guarded(
            optax.adam(1e-3), clip=optclip.adagc(warmup_steps=2), loss_scale=_SCALED
        )
    )
    + _transform(
        lambda: optclip.guarded(
            optax.sgd(0.1), clip=optclip.global_clip(1.0), loss_scale=_SCALED, accumulation_steps=2
        )
    ),
    "agc": _transform(lambda: optclip.agc(), params=True)
    + _transform(lambda: optclip.agc(group_norms=1), params=True),
    "autoclip": _transform(lambda: optclip.autoclip(history=4)),
    "zclip": _transform(lambda: optclip.zclip(group_norms="leaf")),
    "adagc": _transform(lambda: optclip.adagc(warmup_steps=2)),
}

NOT_NUMBERS = {
    "str": ("abc", r"a str: 'abc'"),
    "bytes": (b"ab", r"a bytes: b'ab'"),
    "object array": (
        np.array([1, "x"], dtype=object),
        r"a ndarray of dtype object: array\(\[1, 'x'\], dtype=object\)",
    ),
    "str array": (np.array(["ab"]), r"a ndarray of dtype <U2: array\(\['ab'\], dtype='<U2'\)"),
    "long double": (np.ones(2, np.longdouble), r"a ndarray of dtype float128: array"),
}
if np.dtype(np.longdouble).itemsize <= 8:  # (long double is float64 here: a number JAX has)
    del NOT_NUMBERS["long double"]


def test_every_public_name_is_in_the_leaf_table():
    assert sorted(LEAF_ENTRY_POINTS) == sorted(optclip.__all__)


def _leaf_cases():
    return [
        pytest.param(call, what, id=f"{name}[{i}]{kind}")
        for name, cases in LEAF_ENTRY_POINTS.items()
        if isinstance(cases, list)
        for i, (kind, call, what) in enumerate(cases)
    ]


@pytest.mark.every_case  # (each raises before anything is compiled)
@pytest.mark.parametrize("leaf", NOT_NUMBERS)
@pytest.mark.parametrize("call, what", _leaf_cases())
def test_a_leaf_that_is_not_a_number_is_named_at_every_entry_point(call, what, leaf):
    """Eager, and under `jit` (the bad leaf closed over, the others traced): a `TypeError` that
    names the leaf's path and what it holds, the same from every entry point."""
    value, holds = NOT_NUMBERS[leaf]
    path = r"\[1\]\.global_norm" if call is _metrics else LEAF_PATHS.get(call, r"\['k'\]")
    message = (
        re.escape(what) if what else r"\S+"
    ) + rf" needs numbers or arrays of numbers as leaves; leaf `{path}` is {holds}"

    def run(a):
        good = {"a": a, "k": a + 1}
        return call(good, {"a": a, "k": value})

    for fn in (run, jax.jit(run)):
        with pytest.raises(TypeError, match=message):
            fn(jnp.ones((3, 2)))


@pytest.mark.parametrize(
    "leaf",
    [
        jnp.ones(2),
        np.ones(2, np.float16),
        np.float64(2.0),
        2,
        1.5,
        jax.ShapeDtypeStruct((2,), jnp.float32),
    ],
    ids=repr,
)
def test_numbers_arrays_and_shape_dtype_structs_pass_the_leaf_check(leaf):
    """`init` on abstract parameters (`jax.ShapeDtypeStruct`s) works, as optax's own do."""
    for tx in (optclip.global_clip(1.0, group_norms="leaf"), optclip.norm_clip(1.0)):
        tx.init({"a": jnp.ones(2), "k": leaf})


# `axis_name`: its type is checked when it is given ---------------------------------------


AXIS_NAME_FACTORIES = {
    "global_clip": lambda a: optclip.global_clip(1.0, axis_name=a),
    "autoclip": lambda a: optclip.autoclip(axis_name=a),
    "zclip": lambda a: optclip.zclip(axis_name=a),
    "agc": lambda a: optclip.agc(axis_name=a),
    "global_norm": lambda a: optclip.global_norm(jnp.ones(2), axis_name=a),
    "clip_by_global_norm": lambda a: optclip.clip_by_global_norm(jnp.ones(2), 1.0, axis_name=a),
}


@pytest.mark.parametrize("name", AXIS_NAME_FACTORIES)
@pytest.mark.parametrize(
    "axis_name, held",
    [(5, ""), (("i", 5), r" \(it holds 5\)"), ({"w": 1.0}, r" \(it holds 1.0\)")],
)
def test_axis_name_of_the_wrong_type_is_an_error_at_the_call(name, axis_name, held):
    from jax.sharding import PartitionSpec as P

    accepted = (
        r"`axis_name` must be None, 'auto', a mesh axis name \(a str\), a tuple of names, a "
        r"PartitionSpec, or a pytree of PartitionSpecs / names / None matching the updates "
        r"\(such as shard_map's `in_specs`\); got "
    )
    with pytest.raises(TypeError, match=accepted + r".*" + held + r"\.$"):
        AXIS_NAME_FACTORIES[name](axis_name)
    with pytest.raises(TypeError, match=accepted + r"P\(5,\) \(it holds 5\)"):
        AXIS_NAME_FACTORIES[name](P(5))


def test_axis_name_of_an_accepted_form_is_not_an_error_at_construction():
    from jax.sharding import PartitionSpec as P

    for axis_name in (None, "auto", "i", ("i", "j"), P("i", None), {"w": P("i"), "b": None}):
        optclip.global_clip(1.0, axis_name=axis_name)
        optclip.agc(axis_name=axis_name)


# `metrics` reads a state ----------------------------------------------------------------


def test_metrics_of_an_optimizer_or_a_factory_says_to_pass_the_state():
    opt = optax.chain(optclip.global_clip(1.0), optax.sgd(1.0))
    with pytest.raises(TypeError, match=r"reads the optimizer \*state\*, got the optimizer"):
        optclip.metrics(opt)
    with pytest.raises(TypeError, match=r"got the callable `global_clip`.*optimizer.init"):
        optclip.metrics(optclip.global_clip)
    assert optclip.metrics(opt.init(jnp.ones(2)))  # the state itself is read


FACTORIES = [
    "value_clip",
    "norm_clip",
    "average_norm_clip",
    "block_rms_clip",
    "global_clip",
    "clipped",
    "guarded",
    "agc",
    "autoclip",
    "zclip",
    "adagc",
]


@pytest.mark.every_case
@pytest.mark.parametrize("name", FACTORIES)
def test_a_factory_left_uncalled_in_a_chain_says_to_call_it(name):
    factory = getattr(optclip, name)
    opt = optax.chain(factory, optax.adam(1e-3))  # (optax reads `init` and `update` here)
    message = rf"`optclip.{name}` is a factory of transformations, not a transformation: call it"
    with pytest.raises(TypeError, match=message):
        opt.init({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=message):
        opt.update({"w": jnp.ones(2)}, ((), ()))


# A threshold <= 0 given to a transformation warns; `clipped` and the functions do not ----


NONPOSITIVE = {
    "norm_clip": (lambda: optclip.norm_clip(0.0), r"norm_clip\(max_norm=0.0\)", "clipnorm="),
    "average_norm_clip": (
        lambda: optclip.average_norm_clip(-1),
        r"average_norm_clip\(max_norm=-1\)",
        "leave the clip out",
    ),
    "block_rms_clip": (
        lambda: optclip.block_rms_clip(0),
        r"block_rms_clip\(threshold=0\)",
        "leave the clip out",
    ),
    "global_clip": (
        lambda: optclip.global_clip(np.float32(0.0)),
        r"global_clip\(max_norm=np.float32\(0.0\)\)",
        "global_clipnorm=",
    ),
    "zclip": (lambda: optclip.zclip(max_norm=0.0), r"zclip\(max_norm=0.0\)", "max_norm=None"),
    "agc": (lambda: optclip.agc(clipping=0.0), r"agc\(clipping=0.0\)", "leave the clip out"),
}


@pytest.mark.parametrize("name", NONPOSITIVE)
def test_a_threshold_that_zeroes_every_update_warns_at_construction(name):
    make, call, hint = NONPOSITIVE[name]
    with pytest.warns(UserWarning, match=rf"`{call}` zeroes every update: .*{hint}") as record:
        make()
    assert record[0].filename == __file__  # it points at the caller's line


def test_no_warning_for_clipped_schedules_traced_or_positive_thresholds(recwarn):
    for arg in ("clipnorm", "clipvalue", "global_clipnorm"):
        optclip.clipped(optax.sgd(1.0), **{arg: 0.0})  # Keras: <= 0 turns clipping off
    optclip.global_clip(optax.linear_schedule(0.0, 1.0, 10))
    optclip.global_clip(1e-30)
    optclip.zclip(max_norm=None)
    optclip.agc(clipping=0.01)
    optclip.clip_by_global_norm(jnp.ones(2), 0.0)  # the functions: TensorFlow's rule, quietly
    jax.jit(
        lambda c: optclip.global_clip(c).update(
            jnp.ones(2), optclip.global_clip(c).init(jnp.ones(2))
        )
    )(0.0)
    assert not [w for w in recwarn if "zeroes every update" in str(w.message)]
