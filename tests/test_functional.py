"""The TensorFlow clipping functions against TensorFlow's documented examples and float64."""

import math

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
    ref_clip_by_global_norm,
    ref_clip_by_norm,
    ref_global_norm,
    ref_scale,
    run,
)

import optclip

pytestmark = pytest.mark.usefixtures("strict_promotion")

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]


# TensorFlow's documented examples -------------------------------------------------------------


def test_tf_clip_by_norm_example(mode):
    out = run(lambda x: optclip.clip_by_norm(x, 2.0), mode)(jnp.array([[1.0, 2, 3, 4, 5]]))
    expected = [[0.26967996, 0.5393599, 0.80903983, 1.0787199, 1.3483998]]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_tf_clip_by_norm_keeps_or_shrinks(mode):
    x = jnp.array([-2.0, 3.0, 6.0])
    np.testing.assert_allclose(
        run(lambda t: optclip.clip_by_norm(t, 5.0), mode)(x),
        np.array([-2, 3, 6]) * 5 / 7,
        rtol=1e-6,
    )
    assert np.array_equal(run(lambda t: optclip.clip_by_norm(t, 9.0), mode)(x), x)


def test_tf_clip_by_norm_rows_and_columns(mode):
    x = jnp.array([[3.0, 4.0, 0.0], [0.0, 0.3, 0.4]])
    rows = run(lambda t: optclip.clip_by_norm(t, 1.0, axes=[1]), mode)(x)
    np.testing.assert_allclose(rows, [[0.6, 0.8, 0.0], [0.0, 0.3, 0.4]], rtol=1e-6)
    cols = run(lambda t: optclip.clip_by_norm(t, 1.0, axes=[0]), mode)(x)
    np.testing.assert_allclose(cols, ref_clip_by_norm(x, 1.0, axes=0), rtol=1e-6)
    negative = run(lambda t: optclip.clip_by_norm(t, 1.0, axes=-1), mode)(x)
    np.testing.assert_array_equal(negative, rows)


def test_tf_clip_by_global_norm_example(mode):
    grads = [jnp.array([-2.0, 3.0, 6.0]), jnp.array([-4.0, 6.0, 12.0])]
    clipped, norm = run(lambda g: optclip.clip_by_global_norm(g, 14.5), mode)(grads)
    np.testing.assert_allclose(float(norm), math.sqrt(49 + 196), rtol=1e-6)
    factor = 14.5 / math.sqrt(49 + 196)
    for out, x in zip(clipped, grads):
        np.testing.assert_allclose(out, np.asarray(x) * factor, rtol=1e-6)


def test_tf_clip_by_value_example(mode):
    out = run(lambda x: optclip.clip_by_value(x, 0, 3), mode)(jnp.array([-1.0, 2.0, 10.0]))
    np.testing.assert_array_equal(out, [0.0, 2.0, 3.0])


def test_tf_global_norm_ignores_none():
    assert float(optclip.global_norm([None, jnp.array([3.0, 4.0]), None])) == 5.0


# Against the float64 reference ----------------------------------------------------------------


def _tree(dtype, seed=0):
    rng = np.random.default_rng(seed)
    a, b, c = random_leaves(rng, [(4, 3), (5,), (2, 3, 2)], np.float32)
    return {"a": jnp.asarray(a, dtype), "b": [jnp.asarray(b, dtype), jnp.asarray(c, dtype)]}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("clip", [0.05, 1.0, 1e4])
def test_clip_by_global_norm_matches_reference(dtype, clip, mode):
    tree = _tree(dtype)
    clipped, norm = run(lambda t: optclip.clip_by_global_norm(t, clip), mode)(tree)
    expected, ref_norm = ref_clip_by_global_norm(jax.tree.leaves(tree), clip)
    np.testing.assert_allclose(float(norm), ref_norm, rtol=1e-6)
    for out, exp, x in zip(jax.tree.leaves(clipped), expected, jax.tree.leaves(tree)):
        assert out.dtype == x.dtype
        assert_close(out, exp, dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axes", [None, 0, -1, (0, 1)])
def test_clip_by_norm_matches_reference(dtype, axes, mode):
    rng = np.random.default_rng(1)
    x = jnp.asarray(random_leaves(rng, [(4, 3, 2)], np.float32)[0], dtype)
    out = run(lambda t: optclip.clip_by_norm(t, 0.5, axes=axes), mode)(x)
    assert out.dtype == dtype
    assert_close(out, ref_clip_by_norm(x, 0.5, axes=axes), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_clip_by_average_norm_matches_reference(dtype, mode):
    tree = _tree(dtype, seed=2)
    out = run(lambda t: optclip.clip_by_average_norm(t, 0.01), mode)(tree)
    for leaf, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert leaf.dtype == dtype
        assert_close(leaf, ref_clip_by_average_norm(x, 0.01), dtype)


def test_clip_by_value_on_trees_integers_and_array_bounds(mode):
    tree = {"f": jnp.array([-3.0, 0.5, 7.0], jnp.bfloat16), "i": jnp.array([-5, 1, 9], jnp.int32)}
    out = run(lambda t: optclip.clip_by_value(t, -1.5, 2.5), mode)(tree)
    assert out["f"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
    np.testing.assert_array_equal(as_f64(out["f"]), [-1.5, 0.5, 2.5])
    np.testing.assert_array_equal(out["i"], [-1, 1, 2])  # float bounds rounded inwards
    rows = jnp.arange(6.0).reshape(2, 3)
    out = run(lambda t: optclip.clip_by_value(t, jnp.array([0.0, 2.0, 4.0]), 4.5), mode)(rows)
    np.testing.assert_array_equal(out, [[0.0, 2.0, 4.0], [3.0, 4.0, 4.5]])
    wide = optclip.clip_by_value(jnp.array([-100, 100], jnp.int8), -1e9, 1e9)
    np.testing.assert_array_equal(wide, [-100, 100])


# The numeric contract -------------------------------------------------------------------------

ALL_CLIPS = {
    "global": lambda t, c: optclip.clip_by_global_norm(t, c)[0],
    "norm": optclip.clip_by_norm,
    "norm_rows": lambda t, c: optclip.clip_by_norm(t, c, axes=-1),
    "average": optclip.clip_by_average_norm,
    "block_rms": optclip.clip_by_block_rms,
}


@pytest.mark.parametrize("name", ALL_CLIPS)
@pytest.mark.parametrize("dtype", FLOATS + [jnp.complex64])
def test_identity_bit_for_bit_under_the_threshold(name, dtype, mode):
    tree = _tree(jnp.float32, seed=3)
    if dtype == jnp.complex64:
        tree = jax.tree.map(lambda x: x.astype(dtype) * (1 + 0.5j), tree)
    tree = jax.tree.map(lambda x: x.astype(dtype), tree)
    out = run(lambda t: ALL_CLIPS[name](t, 1e6), mode)(tree)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert a.dtype == b.dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("name", ALL_CLIPS)
def test_negative_threshold_is_zero_and_zero_input_stays_zero(name, mode):
    f = run(lambda t, c: ALL_CLIPS[name](t, c), mode)
    tree = _tree(jnp.float32, seed=4)
    for leaf in jax.tree.leaves(f(tree, -1.0)):
        np.testing.assert_array_equal(leaf, 0.0)
    zeros = jax.tree.map(jnp.zeros_like, tree)
    for threshold in (0.0, -2.0, 1.0):
        for leaf in jax.tree.leaves(f(zeros, threshold)):
            np.testing.assert_array_equal(leaf, 0.0)  # never NaN


@pytest.mark.parametrize("name", ALL_CLIPS)
@pytest.mark.parametrize("at", ["zero", "clipped", "unclipped"])
def test_gradients_are_finite_and_identity_at_zero(name, at):
    x = {
        "zero": jnp.zeros((2, 3)),
        "clipped": jnp.arange(6.0).reshape(2, 3) - 2.0,
        "unclipped": (jnp.arange(6.0).reshape(2, 3) - 2.0) * 1e-3,
    }[at]
    jac = jax.jit(jax.jacobian(lambda t: ALL_CLIPS[name](t, 0.5)))(x).reshape(6, 6)
    assert np.all(np.isfinite(np.asarray(jac)))
    if at != "clipped":
        np.testing.assert_allclose(jac, np.eye(6), atol=1e-7)
    # Gradient with respect to the threshold too (meta-learning).
    dthreshold = jax.jit(jax.grad(lambda c: jnp.sum(ALL_CLIPS[name](x, c))))(0.5)
    assert np.isfinite(float(dthreshold))


def test_gradient_of_clip_by_global_norm_when_clipping():
    x = jnp.array([3.0, 4.0])
    jac = jax.jit(jax.jacobian(lambda t: optclip.clip_by_global_norm(t, 1.0)[0]))(x)
    xx = np.array([3.0, 4.0])
    expected = (np.eye(2) - np.outer(xx, xx) / 25) / 5  # d(c x / |x|)/dx with c = 1
    np.testing.assert_allclose(jac, expected, rtol=1e-6)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_norm_makes_every_leaf_nan(bad, mode):
    tree = {"a": jnp.array([1.0, bad]), "b": jnp.ones(3, jnp.bfloat16)}
    clipped, norm = run(lambda t: optclip.clip_by_global_norm(t, 1.0), mode)(tree)
    assert not np.isfinite(float(norm))
    for leaf in jax.tree.leaves(clipped):
        assert np.all(np.isnan(as_f64(leaf)))


def test_overflowing_squares_are_clipped_correctly(mode):
    x = jnp.array([3e20, -4e20], jnp.float32)
    clipped, norm = run(lambda t: optclip.clip_by_global_norm(t, 1.0), mode)(x)
    np.testing.assert_allclose(float(norm), 5e20, rtol=1e-6)
    np.testing.assert_allclose(clipped, [0.6, -0.8], rtol=1e-6)
    np.testing.assert_allclose(
        run(lambda t: optclip.clip_by_norm(t, 1.0), mode)(x), [0.6, -0.8], rtol=1e-6
    )
    half = jnp.full((4,), 60000.0, jnp.float16)
    out = run(lambda t: optclip.clip_by_norm(t, 1.0), mode)(half)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(as_f64(out), [0.5] * 4, rtol=1e-3)


@pytest.mark.parametrize(
    "threshold",
    [1.0, np.float64(1.0), np.float16(1.0), jnp.bfloat16(1.0), jnp.array(1.0, jnp.float16), 1],
)
def test_thresholds_of_any_float_type(threshold, mode):
    x = jnp.array([3.0, 4.0], jnp.bfloat16)
    clipped, _ = run(lambda t: optclip.clip_by_global_norm(t, threshold), mode)(x)
    assert clipped.dtype == jnp.bfloat16
    np.testing.assert_allclose(as_f64(clipped), [0.6, 0.8], rtol=1e-2)


def test_traced_threshold_does_not_retrace():
    traces = []

    @jax.jit
    def f(t, c):
        traces.append(1)
        return optclip.clip_by_global_norm(t, c)[0]

    x = jnp.array([3.0, 4.0])
    np.testing.assert_allclose(f(x, 1.0), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(f(x, 2.5), [1.5, 2.0], rtol=1e-6)
    assert len(traces) == 1


def test_use_norm_replaces_the_computed_norm(mode):
    x = [jnp.array([3.0, 4.0])]
    clipped, norm = run(lambda t: optclip.clip_by_global_norm(t, 1.0, use_norm=10.0), mode)(x)
    assert float(norm) == 10.0
    np.testing.assert_allclose(clipped[0], [0.3, 0.4], rtol=1e-6)


def test_none_and_masked_nodes_are_kept(mode):
    tree = {"a": None, "b": optax.MaskedNode(), "c": jnp.array([3.0, 4.0])}
    clipped, norm = run(lambda t: optclip.clip_by_global_norm(t, 1.0), mode)(tree)
    assert clipped["a"] is None and isinstance(clipped["b"], optax.MaskedNode)
    np.testing.assert_allclose(clipped["c"], [0.6, 0.8], rtol=1e-6)
    for fn in (
        lambda t: optclip.clip_by_norm(t, 1.0),
        lambda t: optclip.clip_by_value(t, 0, 1),
        lambda t: optclip.clip_by_average_norm(t, 1.0),
    ):
        out = run(fn, mode)(tree)
        assert out["a"] is None and isinstance(out["b"], optax.MaskedNode)


def test_complex_leaves(mode):
    z = jnp.array([3 + 4j, 0j], jnp.complex64)
    out = run(lambda t: optclip.clip_by_norm(t, 1.0), mode)(z)
    assert out.dtype == jnp.complex64
    np.testing.assert_allclose(out, [0.6 + 0.8j, 0], rtol=1e-6)
    clipped, norm = run(lambda t: optclip.clip_by_global_norm(t, 1.0), mode)([z, jnp.ones(1)])
    np.testing.assert_allclose(float(norm), ref_global_norm([z, np.ones(1)]), rtol=1e-6)


def test_per_example_clipping_with_vmap():
    x = jnp.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [3e20, 4e20]])
    out = jax.jit(jax.vmap(lambda g: optclip.clip_by_global_norm(g, 1.0)[0]))(x)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0], [0.6, 0.8]], rtol=1e-6)


# Open bounds in clip_by_value (optax.tree.clip's None) ---------------------------------------


def _ref_clip_by_value(x, lo, hi):
    x = as_f64(x)
    x = x if lo is None else np.maximum(x, lo)
    return x if hi is None else np.minimum(x, hi)


@pytest.mark.parametrize("lo, hi", [(None, 1.5), (-0.5, None), (None, None)])
def test_clip_by_value_with_an_open_bound(lo, hi, mode):
    tree = {"f": jnp.array([-3.0, 0.25, 7.0], jnp.bfloat16), "g": jnp.array([[-2.0, 2.0]])}
    out = run(lambda t: optclip.clip_by_value(t, lo, hi), mode)(tree)
    for key in tree:
        assert out[key].dtype == tree[key].dtype
        np.testing.assert_array_equal(as_f64(out[key]), _ref_clip_by_value(tree[key], lo, hi))
    # Both bounds open: the tree comes back unchanged, as with optax.tree.clip.
    if lo is None and hi is None:
        assert out["g"] is tree["g"] or mode == "jit"


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32, jnp.uint32])
@pytest.mark.parametrize(
    "lo, hi", [(-1.5, np.inf), (-np.inf, 3.7), (-np.inf, np.inf), (None, 3e9), (-3e9, None)]
)
def test_infinite_and_huge_bounds_saturate_for_integer_leaves(dtype, lo, hi, mode):
    info = jnp.iinfo(dtype)
    x = jnp.array([info.min, 0, 5, info.max], dtype)
    out = run(lambda t: optclip.clip_by_value(t, lo, hi), mode)(x)
    assert out.dtype == dtype
    expected = _ref_clip_by_value(
        np.asarray(x), None if lo is None else np.ceil(lo), None if hi is None else np.floor(hi)
    )
    np.testing.assert_array_equal(np.asarray(out, np.float64), expected)


def test_integer_bounds_of_another_integer_dtype(mode):
    x = jnp.array([0, 7, 4294967295], jnp.uint32)
    out = run(lambda t: optclip.clip_by_value(t, -1, jnp.array(6, jnp.int8)), mode)(x)
    assert out.dtype == jnp.uint32
    np.testing.assert_array_equal(out, [0, 6, 6])


# Block RMS (optax.clip_by_block_rms) ----------------------------------------------------------


def _ref_clip_by_block_rms(x, threshold):
    x = as_f64(x)
    rms = np.sqrt(np.mean(np.abs(x) ** 2)) if x.size else 0.0
    return x * ref_scale(rms, threshold)


@pytest.mark.parametrize("dtype", FLOATS + [jnp.complex64])
def test_clip_by_block_rms_matches_reference(dtype, mode):
    tree = _tree(jnp.float32, seed=5)
    if dtype == jnp.complex64:
        tree = jax.tree.map(lambda x: x.astype(dtype) * (1 - 2j), tree)
    tree = jax.tree.map(lambda x: x.astype(dtype), tree)
    f = run(optclip.clip_by_block_rms, mode)
    for threshold in (0.05, 1.0, 1e4):  # traced under jit: one compilation
        out = f(tree, threshold)
        for leaf, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
            assert leaf.dtype == dtype and leaf.shape == x.shape
            assert_close(leaf, _ref_clip_by_block_rms(x, threshold), dtype)


def test_clip_by_block_rms_agrees_with_optax(mode):
    tree = _tree(jnp.float32, seed=6)
    f = run(optclip.clip_by_block_rms, mode)
    for threshold in (0.1, 1.0, 100.0):
        theirs, _ = optax.clip_by_block_rms(threshold).update(tree, optax.EmptyState())
        for a, b in zip(jax.tree.leaves(f(tree, threshold)), jax.tree.leaves(theirs)):
            np.testing.assert_allclose(a, b, rtol=4e-6)


def test_clip_by_block_rms_where_it_differs_from_optax_on_purpose(mode):
    f = run(optclip.clip_by_block_rms, mode)
    # float16 squares that overflow: the true RMS (300), not zeros.
    half = f(jnp.full((4,), 300.0, jnp.float16), 1.0)
    assert half.dtype == jnp.float16
    np.testing.assert_allclose(as_f64(half), [1.0] * 4, rtol=1e-3)
    # A negative threshold is zero (TensorFlow), zero input stays zero at a zero threshold.
    np.testing.assert_array_equal(f(jnp.array([3.0, 4.0]), -1.0), [0.0, 0.0])
    np.testing.assert_array_equal(f(jnp.zeros(2), 0.0), [0.0, 0.0])
    # A leaf whose RMS is not finite is NaN as a whole; the other leaves are clipped alone.
    out = f({"a": jnp.array([np.inf, 1.0]), "b": jnp.array([3.0, 4.0])}, 1.0)
    assert np.all(np.isnan(np.asarray(out["a"])))
    np.testing.assert_allclose(out["b"], _ref_clip_by_block_rms([3.0, 4.0], 1.0), rtol=1e-6)


# NaN thresholds: a concrete NaN is an error, a traced one makes the result NaN -----------------

FUNCTIONS_OF_A_THRESHOLD = {
    "clip_by_norm": optclip.clip_by_norm,
    "clip_by_average_norm": optclip.clip_by_average_norm,
    "clip_by_block_rms": optclip.clip_by_block_rms,
    "clip_by_global_norm": lambda t, c: optclip.clip_by_global_norm(t, c)[0],
    "clip_by_value_min": lambda t, c: optclip.clip_by_value(t, c, None),
    "clip_by_value_max": lambda t, c: optclip.clip_by_value(t, -1.0, c),
}


@pytest.mark.parametrize("name", FUNCTIONS_OF_A_THRESHOLD)
@pytest.mark.parametrize("under", ["zero", "over"])
def test_traced_nan_threshold_makes_every_leaf_nan(name, under):
    tree = {"a": jnp.full((2,), 3.0 if under == "over" else 0.0), "b": jnp.ones(3, jnp.bfloat16)}
    out = jax.jit(FUNCTIONS_OF_A_THRESHOLD[name])(tree, jnp.nan)
    for leaf, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert leaf.dtype == x.dtype
        assert np.all(np.isnan(as_f64(leaf)))  # never a silent "no clip"


def test_nan_use_norm_is_a_norm_not_an_error(mode):
    x = [jnp.array([3.0, 4.0])]
    clipped, norm = run(lambda t: optclip.clip_by_global_norm(t, 1.0, use_norm=np.nan), mode)(x)
    assert np.isnan(float(norm)) and np.all(np.isnan(np.asarray(clipped[0])))
