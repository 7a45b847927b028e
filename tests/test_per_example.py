"""Per-example clipping (DP-SGD) against a float64 reference, optax, and vmap of the global clip."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import as_f64, assert_close, equations

import optclip

# optclip's own code under strict dtype promotion (optax's per-example functions run fine too).
pytestmark = pytest.mark.usefixtures("strict_promotion")

FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]
B = 5
SHAPES = {"w": (3, 4), "b": (4,), "out": (2,)}

# Shared jitted functions: tests that use the same shapes share one compilation (the suite
# stays fast on a small machine). They return the norms too: (summed, num_clipped, norms).
CLIP = jax.jit(
    functools.partial(optclip.per_example_clip, return_norms=True), static_argnames=("nonfinite",)
)
LAYER = jax.jit(
    functools.partial(optclip.per_example_layer_clip, return_norms=True),
    static_argnames=("uniform", "nonfinite"),
)
OPTAX_CLIP = jax.jit(optax.per_example_global_norm_clip)
OPTAX_LAYER = jax.jit(optax.per_example_layer_norm_clip, static_argnames=("uniform",))


def clip_fn(mode, **kwargs):
    if mode == "eager":
        return lambda g, c: optclip.per_example_clip(g, c, return_norms=True, **kwargs)
    return lambda g, c: CLIP(g, c, **kwargs)


def layer_fn(mode, **kwargs):
    if mode == "eager":
        return lambda g, c: optclip.per_example_layer_clip(g, c, return_norms=True, **kwargs)
    return lambda g, c: LAYER(g, c, **kwargs)


def batch(dtype, seed=0, spread=True, shapes=SHAPES, batch_size=B):
    """A dict of per-example gradients: every leaf has the leading batch axis; examples of
    norms spread over four decades, so that some are clipped and some are not."""
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(-2, 2, size=batch_size) if spread else np.ones(batch_size)
    out = {}
    for name, shape in shapes.items():
        x = rng.standard_normal((batch_size, *shape)) * scales.reshape((-1,) + (1,) * len(shape))
        out[name] = jnp.asarray(x.astype(np.float32), dtype)
    return out


def ref_example_norms(leaves):
    """Float64 per-example norms of a list of leaves (shape (B,))."""
    total = sum(np.sum(np.abs(as_f64(x)) ** 2, axis=tuple(range(1, x.ndim))) for x in leaves)
    return np.sqrt(total)


def ref_scales(norms, threshold):
    threshold = max(float(threshold), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(norms > threshold, threshold / np.where(norms > 0, norms, 1), 1.0)
    return np.where(np.isfinite(norms), scales, np.nan)


def ref_weighted_sum(x, scales):
    x = as_f64(x)
    return np.tensordot(scales, x, axes=1)


def ref_per_example_clip(tree, threshold):
    """``(summed, norms, num_clipped)`` in float64."""
    leaves = list(tree.values())
    norms = ref_example_norms(leaves)
    scales = ref_scales(norms, threshold)
    summed = {k: ref_weighted_sum(x, scales) for k, x in tree.items()}
    return summed, norms, int(np.sum(np.isfinite(norms) & (norms > max(threshold, 0.0))))


def ref_layer_thresholds(tree, threshold, uniform):
    threshold = max(float(threshold), 0.0)
    sizes = {k: math.prod(x.shape[1:]) for k, x in tree.items()}
    if uniform:
        return {k: threshold / math.sqrt(len(tree)) for k in tree}
    total = sum(sizes.values())
    return {k: threshold * math.sqrt(sizes[k] / total) for k in tree}


def ref_per_example_layer_clip(tree, threshold, uniform):
    thresholds = ref_layer_thresholds(tree, threshold, uniform)
    summed, norms, counts = {}, {}, {}
    for k, x in tree.items():
        n = ref_example_norms([x])
        summed[k] = ref_weighted_sum(x, ref_scales(n, thresholds[k]))
        norms[k] = n
        counts[k] = int(np.sum(n > thresholds[k]))
    return summed, norms, counts


def assert_sum_close(actual, expected, dtype):
    """The sum is rounded once to `dtype` from a float32 accumulation of a few examples."""
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype, factor=2.0)


# Against the float64 reference ------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_per_example_clip_matches_reference(dtype, mode):
    tree = batch(dtype)
    summed, num_clipped, norms = clip_fn(mode)(tree, 1.0)
    ref_summed, ref_norms, ref_count = ref_per_example_clip(tree, 1.0)
    assert 0 < ref_count < B  # some examples clipped, some not
    for k in tree:
        assert_sum_close(summed[k], ref_summed[k], dtype)
    assert norms.dtype == jnp.float32 and norms.shape == (B,)
    np.testing.assert_allclose(norms, ref_norms, rtol=2e-6)  # exact values of the leaves
    assert num_clipped.dtype == jnp.int32 and int(num_clipped) == ref_count


# Eager and jit differ only in Python-level decisions, the same for every dtype (all three
# dtypes run eagerly in the test above): eager once here, to keep the suite fast.
@pytest.mark.parametrize("dtype, mode", [(d, "jit") for d in FLOATS] + [(jnp.float32, "eager")])
def test_per_example_layer_clip_matches_reference(dtype, mode):
    tree = batch(dtype, seed=1)
    summed, counts, norms = layer_fn(mode)(tree, 2.0)
    ref_summed, ref_norms, ref_counts = ref_per_example_layer_clip(tree, 2.0, True)
    for k in tree:
        assert_sum_close(summed[k], ref_summed[k], dtype)
        assert norms[k].dtype == jnp.float32 and norms[k].shape == (B,)
        np.testing.assert_allclose(norms[k], ref_norms[k], rtol=2e-6)
        assert counts[k].dtype == jnp.int32 and int(counts[k]) == ref_counts[k]


# Huge values and overflowing squares: clipped correctly, where optax drops the example -----


@jax.jit
def optax_per_example(leaves):
    """optax's per-example norms and clipped sum (threshold 1)."""
    norms = jax.vmap(optax.tree.norm)(leaves)
    return norms, optax.per_example_global_norm_clip(leaves, 1.0)[0]


def test_huge_example_is_clipped_where_optax_drops_it():
    tree = batch(jnp.float32, seed=12)
    tree["w"] = tree["w"].at[1].set(1e20)  # example 1: norm sqrt(12) * 1e20
    summed, num_clipped, norms = CLIP(tree, 1.0)
    ref_summed, ref_norms, ref_count = ref_per_example_clip(tree, 1.0)
    for k in tree:
        assert_close(summed[k], ref_summed[k], jnp.float32, factor=2.0)
    np.testing.assert_allclose(norms, ref_norms, rtol=2e-6)
    assert int(num_clipped) == ref_count
    # optax: the norm of 1e20-sized values overflows to inf and the example is dropped.
    optax_norms, optax_summed = optax_per_example(list(tree.values()))
    assert not np.isfinite(optax_norms[1])
    dropped = {k: np.asarray(x).copy() for k, x in tree.items()}
    for x in dropped.values():
        x[1] = 0
    for a, k in zip(optax_summed, tree):
        assert_close(a, ref_per_example_clip(dropped, 1.0)[0][k], jnp.float32, factor=2.0)


def test_float16_squares_overflow_is_clipped_where_optax_drops_it():
    tree = batch(jnp.float16, spread=False)
    tree["w"] = tree["w"].at[0].set(3000.0)  # squares overflow float16 (max 65504)
    summed, _, norms = CLIP(tree, 1.0)
    ref_summed, ref_norms, _ = ref_per_example_clip(tree, 1.0)
    for k in tree:
        assert_sum_close(summed[k], ref_summed[k], jnp.float16)
    np.testing.assert_allclose(norms, ref_norms, rtol=2e-6)
    # optax: the float16 norm of example 0 is inf and the example is dropped.
    optax_norms, optax_summed = optax_per_example(list(tree.values()))
    optax_norms = as_f64(optax_norms)
    assert not np.isfinite(optax_norms[0]) and np.all(np.isfinite(optax_norms[1:]))
    dropped = {k: np.asarray(x).copy() for k, x in tree.items()}
    for x in dropped.values():
        x[0] = 0
    for a, k in zip(optax_summed, tree):
        assert_close(a, ref_per_example_clip(dropped, 1.0)[0][k], jnp.float16, factor=4.0)


def test_layer_clip_huge_and_tiny_values():
    tree = batch(jnp.float32, seed=13)
    tree["w"] = tree["w"].at[0].set(1e20)
    tree["b"] = tree["b"].at[0].set(1e-30)  # squares underflow: the fallback rescales them
    summed, counts, norms = LAYER(tree, 2.0)
    ref_summed, ref_norms, ref_counts = ref_per_example_layer_clip(tree, 2.0, True)
    for k in tree:
        assert_close(summed[k], ref_summed[k], jnp.float32, factor=2.0)
        np.testing.assert_allclose(norms[k], ref_norms[k], rtol=2e-6)
        assert int(counts[k]) == ref_counts[k]


def test_bfloat16_sum_accumulated_in_float32():
    # 256 + 1 + 1 + 1 + 1: a bfloat16 running sum stalls at 256 (its spacing there is 2).
    tree = jax.tree.map(jnp.zeros_like, batch(jnp.bfloat16))
    tree["out"] = tree["out"].at[:, 0].set(jnp.array([256, 1, 1, 1, 1], jnp.bfloat16))
    summed, _, _ = CLIP(tree, 1e3)
    assert summed["out"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(as_f64(summed["out"]), [260.0, 0.0])


# Against optax where optax is right, and against vmap of the global clip -------------------


@pytest.mark.parametrize("threshold", [0.1, 1.0, 1e3, 0.0, np.inf])
def test_equals_optax_on_moderate_float32(threshold):
    tree = batch(jnp.float32, seed=2)
    summed, num_clipped, _ = CLIP(tree, threshold)
    ref_summed, ref_count = OPTAX_CLIP(list(tree.values()), threshold)
    for k, b in zip(tree, ref_summed):  # optax takes a list of arrays
        np.testing.assert_allclose(summed[k], b, rtol=2e-6, atol=1e-7)
    assert int(num_clipped) == int(ref_count)


@pytest.mark.parametrize("uniform", [True, False])
def test_layer_clip_equals_optax_on_moderate_float32(uniform):
    tree = batch(jnp.float32, seed=3)
    summed, counts, _ = LAYER(tree, 1.5, uniform=uniform)
    ref_summed, ref_counts = OPTAX_LAYER(list(tree.values()), 1.5, uniform=uniform)
    for k, b, n in zip(tree, ref_summed, ref_counts):
        np.testing.assert_allclose(summed[k], b, rtol=2e-6, atol=1e-7)
        assert int(counts[k]) == int(n)


def test_equals_vmap_of_clip_by_global_norm_summed():
    tree = batch(jnp.float32, seed=4)
    tree["w"] = tree["w"].at[1].set(1e20)  # the library's own vmap path handles it too

    @jax.jit
    def vmapped(g):
        clipped = jax.vmap(lambda e: optclip.clip_by_global_norm(e, 1.0)[0])(g)
        return jax.tree.map(lambda x: x.sum(0), clipped)

    summed, _, _ = CLIP(tree, 1.0)
    expected = vmapped(tree)
    for k in tree:
        np.testing.assert_allclose(summed[k], expected[k], rtol=2e-6, atol=1e-7)


# Thresholds, zeros, tracing, gradients -----------------------------------------------------


def test_zero_gradients_stay_zero():
    for dtype in (jnp.float32, jnp.bfloat16):
        tree = {k: np.zeros((B, *s), dtype) for k, s in SHAPES.items()}  # (compiles nothing)
        for threshold in (0.0, -1.0, 1.0):
            for fn in (CLIP, LAYER):
                summed, counts, norms = fn(tree, threshold)
                for k in tree:
                    assert summed[k].dtype == dtype
                    np.testing.assert_array_equal(as_f64(summed[k]), 0.0)
                norms = np.concatenate([np.ravel(n) for n in jax.tree.leaves(norms)])
                np.testing.assert_array_equal(norms, 0.0)
                assert all(int(c) == 0 for c in jax.tree.leaves(counts))


def test_zero_or_negative_threshold_gives_zero():
    tree = batch(jnp.float32, seed=6)
    for threshold in (0.0, -2.5):
        summed, num_clipped, _ = CLIP(tree, threshold)
        for k in tree:
            np.testing.assert_array_equal(summed[k], 0.0)
        assert int(num_clipped) == B
        summed, counts, _ = LAYER(tree, threshold)
        for k in tree:
            np.testing.assert_array_equal(summed[k], 0.0)
            assert int(counts[k]) == B


def test_traced_threshold_does_not_recompile(caplog):
    tree = batch(jnp.float32, seed=7)
    CLIP(tree, 1.0), LAYER(tree, 1.0)  # compiled once (a Python float is traced under jit)
    with jax.log_compiles(True), caplog.at_level("DEBUG"):
        for c in (0.5, 2.0, 8.0, 0.25):
            summed, _, _ = CLIP(tree, c)
            layer, _, _ = LAYER(tree, c)
            ref, _, _ = ref_per_example_clip(tree, c)
            ref_layer, _, _ = ref_per_example_layer_clip(tree, c, True)
            for k in tree:
                assert_close(summed[k], ref[k], jnp.float32, factor=4.0)
                assert_close(layer[k], ref_layer[k], jnp.float32, factor=4.0)
    assert not [r for r in caplog.records if "Compiling jit(per_example" in r.getMessage()]


@pytest.mark.parametrize("fn", [optclip.per_example_clip, optclip.per_example_layer_clip])
def test_gradient_is_finite(fn):
    def loss(g, c):
        summed = fn(g, c)[0]
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(summed))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for scale in (0.0, 1.0, 1e20):
        tree = batch(jnp.float32, seed=8, spread=False)  # (NumPy products: compile nothing)
        tree = jax.tree.map(lambda x, s=scale: np.asarray(x) * np.float32(s), tree)
        grads, dc = grad(tree, 1.0)
        for x in jax.tree.leaves(grads):
            assert np.all(np.isfinite(x))
        assert np.isfinite(dc)
        if scale == 0.0:  # identity at zero input: d(sum)/d(example) is the upstream gradient
            for x in jax.tree.leaves(grads):
                np.testing.assert_allclose(x, 1.0)


# Non-finite examples ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_example_propagates_or_is_dropped(bad, mode):
    tree = batch(jnp.float32, seed=9)
    tree["b"] = tree["b"].at[2, 0].set(bad)
    summed, num_clipped, norms = clip_fn(mode)(tree, 1.0)
    for k in tree:
        assert np.all(np.isnan(summed[k]))
    assert not np.isfinite(norms[2]) and np.all(np.isfinite(np.delete(norms, 2)))

    summed, num_clipped, norms = clip_fn(mode, nonfinite="zero")(tree, 1.0)
    kept = {k: np.delete(np.asarray(x), 2, axis=0) for k, x in tree.items()}
    ref_summed, _, ref_count = ref_per_example_clip(kept, 1.0)
    for k in tree:
        assert_close(summed[k], ref_summed[k], jnp.float32, factor=2.0)
    assert int(num_clipped) == ref_count  # the non-finite example is not counted


@pytest.mark.parametrize("policy", ["propagate", "zero"])
def test_layer_nonfinite_example(policy):
    tree = batch(jnp.float32, seed=10)
    tree["out"] = tree["out"].at[1, 1].set(np.inf)
    kwargs = {} if policy == "propagate" else {"nonfinite": policy}  # one compilation each
    summed, counts, norms = LAYER(tree, 1.0, **kwargs)
    assert not np.isfinite(norms["out"][1]) and np.isfinite(norms["w"][1])
    if policy == "propagate":  # every leaf NaN, not just the one that blew up
        for k in tree:
            assert np.all(np.isnan(summed[k]))
        return
    kept = {k: np.delete(np.asarray(x), 1, axis=0) for k, x in tree.items()}
    ref_summed, _, ref_counts = ref_per_example_layer_clip(kept, 1.0, True)
    for k in tree:  # the whole example is left out, every leaf of it
        assert_close(summed[k], ref_summed[k], jnp.float32, factor=2.0)
        assert int(counts[k]) == ref_counts[k]


def test_nan_threshold_under_jit_is_nan_for_both_policies():
    tree = batch(jnp.float32, seed=11)
    for kwargs in ({}, {"nonfinite": "zero"}):
        summed, _, _ = CLIP(tree, jnp.nan, **kwargs)
        assert all(np.all(np.isnan(x)) for x in jax.tree.leaves(summed))


# Trees: None and MaskedNode leaves, complex leaves, an empty tree ---------------------------


@pytest.mark.slow  # eager, both functions: ~4 s
def test_none_and_masked_leaves_are_kept():
    grads = batch(jnp.float32, seed=14)
    tree = {"a": None, "m": optax.MaskedNode(), **grads}
    for fn in (optclip.per_example_clip, optclip.per_example_layer_clip):
        summed, counts, norms = fn(tree, 1.0, return_norms=True)
        expected = fn(grads, 1.0, return_norms=True)
        assert summed["a"] is None and isinstance(summed["m"], optax.MaskedNode)
        for got, want in zip(jax.tree.leaves((summed, counts, norms)), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(got, want)
    _, counts, norms = optclip.per_example_layer_clip(tree, 1.0, return_norms=True)
    assert norms["a"] is None and isinstance(counts["m"], optax.MaskedNode)


def test_complex_leaves_use_squared_modulus():
    z = jnp.array([[3 + 4j], [0.3 + 0.4j]], jnp.complex64)
    summed, num_clipped, norms = CLIP(z, 1.0)
    assert summed.dtype == jnp.complex64
    np.testing.assert_allclose(summed, [0.9 + 1.2j], rtol=1e-6)
    np.testing.assert_allclose(norms, [5.0, 0.5], rtol=1e-6)


def test_empty_tree():
    summed, num_clipped, norms = optclip.per_example_clip({}, 1.0, return_norms=True)
    assert summed == {} and norms.shape == (0,) and int(num_clipped) == 0
    assert len(optclip.per_example_clip({}, 1.0)) == 2
    assert optclip.per_example_layer_clip({}, 1.0) == ({}, {})
    assert optclip.per_example_layer_clip({}, 1.0, return_norms=True) == ({}, {}, {})


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_no_clipped_copy_of_the_batch_is_made():
    """One contraction per leaf with the scales: the compiled function's temporaries are much
    smaller than the batch (a per-example clipped copy would be as large)."""
    grads = [jnp.ones((16, 64, 64)), jnp.ones((16, 64))]
    size = sum(x.size * x.dtype.itemsize for x in grads)
    compiled = CLIP.lower(grads, 1.0).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < size / 4


@pytest.mark.every_case
@pytest.mark.parametrize("fn", [optclip.per_example_clip, optclip.per_example_layer_clip])
@pytest.mark.parametrize("default", [None, "bfloat16", "tensorfloat32"])
def test_the_weighted_sums_are_exact_at_any_default_matmul_precision(fn, default):
    """The clipped sum is a product of the scales with the gradients: at JAX's default
    precision a GPU would round both to TF32 (10 bits), a TPU to bfloat16. It is computed at
    HIGHEST whatever the default (this machine's products are float32 at every precision:
    what the step asks for is checked)."""
    grads = {"w": jnp.ones((B, 3, 4)), "b": jnp.ones((B, 4), jnp.bfloat16)}
    with jax.default_matmul_precision(default):
        jaxpr = jax.make_jaxpr(lambda g: fn(g, 1.0))(grads).jaxpr
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    dots = [e.params["precision"] for e in equations(jaxpr) if e.primitive.name == "dot_general"]
    assert dots == [highest, highest]


# Errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [optclip.per_example_clip, optclip.per_example_layer_clip])
def test_errors(fn):
    name = fn.__name__
    with pytest.raises(ValueError, match=rf"`{name}` needs a leading batch axis.*`\['b'\]` is 0-d"):
        fn({"a": jnp.ones((2, 3)), "b": jnp.ones(())}, 1.0)
    with pytest.raises(
        ValueError,
        match=r"same batch size.*leaf `\['b'\]` has 3 \(shape \(3, 2\)\), leaf `\['a'\]` has 2",
    ):
        fn({"a": jnp.ones((2, 3)), "b": jnp.ones((3, 2))}, 1.0)
    with pytest.raises(TypeError, match=rf"{name} needs floating-point.*`\['i'\]`.*int32"):
        fn({"i": jnp.ones((2, 3), jnp.int32)}, 1.0)
    with pytest.raises(ValueError, match=r"`max_norm` must be a scalar.*shape \(2,\)"):
        fn(jnp.ones((2, 3)), jnp.ones(2))
    with pytest.raises(ValueError, match=r"`nonfinite` must be one of 'propagate', 'zero'"):
        fn(jnp.ones((2, 3)), 1.0, nonfinite="skip")
    with pytest.raises(ValueError, match=r"`max_norm` must not be NaN"):
        fn(jnp.ones((2, 3)), float("nan"))


def test_switches_must_be_python_bools():
    with pytest.raises(TypeError, match=r"`uniform` must be a Python bool, got ArrayImpl"):
        optclip.per_example_layer_clip(jnp.ones((2, 3)), 1.0, uniform=jnp.array(True))
    with pytest.raises(TypeError, match=r"`return_norms` must be a Python bool, got int: 1"):
        optclip.per_example_clip(jnp.ones((2, 3)), 1.0, return_norms=1)


def test_traced_switch_says_to_make_it_static():
    """Under `jax.jit` a bool argument is traced: the error says how to make it static."""
    expected = (
        r"`uniform` decides the structure of the computation, so it must be a Python bool when "
        r"the function is traced; got a traced value \(DynamicJaxprTracer\)\. Make it a static "
        r"argument: `jax.jit\(f, static_argnames=\('uniform',\)\)`"
    )
    with pytest.raises(TypeError, match=expected):
        jax.jit(optclip.per_example_layer_clip)(jnp.ones((2, 3)), 1.0, uniform=False)
    with pytest.raises(TypeError, match=r"static_argnames=\('return_norms',\)"):
        jax.jit(optclip.per_example_clip)(jnp.ones((2, 3)), 1.0, return_norms=True)


def test_drop_in_for_optax_two_values_and_positional_uniform():
    """Swapping optax's functions for optclip's keeps every call and unpacking working."""
    grads = [np.array([[0.0, 3.0, 4.0], [4.0, 0.0, 3.0]], np.float32)]
    grads.append(np.array([[1.0], [2.0]], np.float32))
    pairs = (
        (optclip.per_example_clip, optax.per_example_global_norm_clip, (1.25,)),
        (optclip.per_example_layer_clip, optax.per_example_layer_norm_clip, (1.25, False)),
    )

    @jax.jit  # (every call in one program: one compile, not ~100 eager ones)
    def calls(grads):
        out = []
        for ours, theirs, args in pairs:
            summed, num_clipped = ours(grads, *args)
            ref_summed, ref_num_clipped = theirs(grads, *args)
            out.append((summed, num_clipped, ref_summed, ref_num_clipped))
        return out

    for summed, num_clipped, ref_summed, ref_num_clipped in calls(grads):
        assert jax.tree.structure(summed) == jax.tree.structure(ref_summed)
        assert jax.tree.structure(num_clipped) == jax.tree.structure(ref_num_clipped)
        for got, want in zip(jax.tree.leaves(summed), jax.tree.leaves(ref_summed)):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        for got, want in zip(jax.tree.leaves(num_clipped), jax.tree.leaves(ref_num_clipped)):
            assert int(got) == int(want)


# Property: every example, clipped, is within the threshold and keeps its direction ----------

examples = hnp.arrays(np.float32, (B, 3, 4), elements=st.floats(-1e6, 1e6, width=32))


@settings(max_examples=40, deadline=None)
@given(examples, st.floats(0.125, 8192.0, width=32))
def test_each_clipped_example_within_threshold_and_direction_kept(w, c):
    zeros = jax.tree.map(np.zeros_like, batch(jnp.float32))
    norms = ref_example_norms([w])
    for b in range(B):
        alone = w * (np.arange(B) == b)[:, None, None]  # the sum is example b, clipped
        summed, _, _ = CLIP({**zeros, "w": jnp.asarray(alone)}, c)
        clipped = as_f64(summed["w"])
        assert np.linalg.norm(clipped) <= c * (1 + 1e-6)
        expected = as_f64(w[b]) * (min(1.0, c / norms[b]) if norms[b] > 0 else 1.0)
        np.testing.assert_allclose(clipped, expected, rtol=1e-5, atol=1e-6 * c)
