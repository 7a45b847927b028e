"""Exactness at every magnitude, checked differentially against float64 NumPy (hypothesis).

Every result is compared with a float64 reference computed from the exact values of the inputs:

* norms (`global_norm`, every order) of float32 leaves from 1e-30 to 1e30 and of float16 and
  bfloat16 leaves over their whole normal range, mixed magnitudes in one tree included, within
  float32 accumulation (relative 1e-6; 2e-6 for orders 0.5 and 3);
* eager and jitted norms are the same bits;
* a NaN anywhere gives a NaN norm for every order (the infinity norm of large arrays included),
  an inf without NaN an inf norm, and ``global_clip(nonfinite="zero")`` then zeroes the update;
* the clips (`clip_by_global_norm`, `clip_by_norm`, per row too) give ``x * c / max(norm, c)``
  at every magnitude of values and thresholds, the input bit for bit under the threshold, and a
  norm of exactly the threshold above it;
* complex64 leaves (norms of ``|z|``; bits, signed zeros included, kept under the threshold);
* trees mixing float64 and float32 leaves under ``jax.enable_x64``;
* gradients (VJPs) of the clips and norms against their analytic float64 Jacobians;
* `global_clip`'s update and state agree bit for bit with the functions.

Every property test runs a few examples in the fast tier and many in the slow tier (its
``examples`` parameter; see conftest.py); only the slow tier shrinks a failing example. The fast
tier runs the jitted functions only, in the property tests and in the fixed examples (an eager
run compiles each operation of the function on its own). The slow tier runs each property test
eagerly and jitted, and the fixed examples eagerly (their `way` fixture's other case). The fast
tier checks that eager and jitted norms are the same bits. Shapes come from a small fixed set,
so each jitted function compiles once per (tree structure, dtype) and only the values vary.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings, target
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import as_f64, ref_global_norm

import optclip
from optclip.norms import _scale

FAST_EXAMPLES = 6
# Hypothesis examples per property test: the fast tier runs the first, the slow tier the other
# (more for the cheap tests of the norms and clips, whose failures lie in narrow bands).
EXAMPLES = [FAST_EXAMPLES, 120]
MORE_EXAMPLES = [FAST_EXAMPLES, 300]
NORM_EXAMPLES = [FAST_EXAMPLES, 500]
ALL_PHASES = tuple(Phase)
NO_SHRINK = tuple(phase for phase in Phase if phase not in (Phase.shrink, Phase.explain))

ORDS = [0.5, 1.0, 2.0, 3.0, math.inf]
# float32 accumulation: a few roundings; `pow` and the root of orders 0.5 and 3 add a few more.
NORM_RTOL = {0.5: 2e-6, 1.0: 1e-6, 2.0: 1e-6, 3.0: 2e-6, math.inf: 1e-6}
CLIP_RTOL = 1e-5
VJP_RTOL = 1e-4

DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(jnp.bfloat16),
    "float64": np.dtype(np.float64),
}


def _normal_range(name):
    """log10 of the smallest and largest normal magnitudes drawn for a dtype."""
    if name == "float32":
        return -30.0, 30.0
    if name == "float64":
        return -300.0, 300.0
    info = jnp.finfo(DTYPES[name])
    return math.log10(float(info.smallest_normal)) + 0.01, math.log10(float(info.max)) - 0.01


# log10 of the magnitudes around which the powers of an order flush to zero or overflow:
# float32 squares (1.1e-19, 1.8e19) and cubes (2.3e-13, 7e12), float64 squares (1.5e-154,
# 1.3e154). Draws are biased towards them (and towards the ends of the range).
EDGES = {
    0.5: (),
    1.0: (),
    2.0: (-18.96, 19.27, -153.8, 154.1),
    3.0: (-12.64, 12.84, -102.6, 102.8),
    math.inf: (),
}

# Fixed tree structures: one compile per (function, order, structure, dtype).
TREE_SHAPES = {
    "array": (7,),
    "scalar": (),
    "empty": (0,),
    "few": [(), (0,), (3,), (2, 5)],
    "many": [(3,)] * 40,
}
CLIP_SHAPES = [(), (3,), (2, 5)]
ROW_SHAPES = [(2, 5), (4, 3)]
COMPLEX_SHAPES = [(3,), (2, 5)]
VJP_SIZE = 5
COTANGENT_ELEMENTS = st.floats(-2, 2, width=32, allow_subnormal=False)


# ----------------------------------------------------------------------------------------------
# Jitted functions, one per (function, order), built once so that their compiles are reused.


def _global_clip_step(tree, c, p=2.0):
    tx = optclip.global_clip(c, ord=p)
    return tx.update(tree, tx.init(tree))


def _zeroing_step(tree, p):
    tx = optax.chain(optclip.global_clip(1.0, ord=p, nonfinite="zero"))
    return tx.update(tree, tx.init(tree))


def _clip_global_tree(tree, c):
    return optclip.clip_by_global_norm(tree, c)


def _clip_leaves(tree, c):
    return optclip.clip_by_norm(tree, c)


def _clip_rows(tree, c):
    return optclip.clip_by_norm(tree, c, axes=-1)


def _clip_global_only(x, c):
    return optclip.clip_by_global_norm(x, c)[0]


def _global_clip_update(x, c):
    tx = optclip.global_clip(c)  # (the transformation, differentiated through its update)
    return tx.update(x, tx.init(x))[0]


def _clip_vjp(clip):
    def vjp(x, c, g):
        _, pullback = jax.vjp(clip, x, c)
        return pullback(g)

    return vjp


def _norm_vjp(p):
    def vjp(x, g):
        _, pullback = jax.vjp(partial(optclip.global_norm, ord=p), x)
        return pullback(g)[0]

    return vjp


NORM = {p: partial(optclip.global_norm, ord=p) for p in ORDS}
NORM_JIT = {p: jax.jit(fn) for p, fn in NORM.items()}
ZEROING = {p: partial(_zeroing_step, p=p) for p in ORDS}
ZEROING_JIT = {p: jax.jit(fn) for p, fn in ZEROING.items()}
GLOBAL_CLIP_STEP_JIT = jax.jit(_global_clip_step)
CLIPS = {"clip_by_global_norm": _clip_global_tree, "clip_by_norm": _clip_leaves}
CLIPS_JIT = {name: jax.jit(fn) for name, fn in CLIPS.items()}
ROW_CLIP_JIT = jax.jit(_clip_rows)
CLIP_VJP = {
    "clip_by_global_norm": _clip_vjp(_clip_global_only),
    "clip_by_norm": _clip_vjp(optclip.clip_by_norm),
    "global_clip": _clip_vjp(_global_clip_update),
}
CLIP_VJP_JIT = {name: jax.jit(fn) for name, fn in CLIP_VJP.items()}
NORM_VJP = {p: _norm_vjp(p) for p in ORDS}
NORM_VJP_JIT = {p: jax.jit(fn) for p, fn in NORM_VJP.items()}


# The ways the checks run now run their functions (`_eager_and_jit`): set by `_property` and
# by the `way` fixture, and by nothing else.
_WAYS: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("ways", default=None)


@contextlib.contextmanager
def _running(*ways: str):
    token = _WAYS.set(ways)
    try:
        yield
    finally:
        _WAYS.reset(token)


def _eager_and_jit(eager, jitted):
    """The ways a check runs a function: those `_running` names (a property test's, or a fixed
    example's `way`)."""
    ways = _WAYS.get()
    if ways is None:
        raise RuntimeError(
            "a check ran outside `_property` and without the `way` fixture: add "
            '`@pytest.mark.usefixtures("way")` to the test, so that each tier runs it one way'
        )
    functions = {"eager": eager, "jit": jitted}
    return tuple((how, functions[how]) for how in ways)


@pytest.fixture(params=["jit", pytest.param("eager", marks=pytest.mark.slow)])
def way(request):
    """A fixed example's checks run each function one way: jitted (the fast tier), or eagerly
    (the slow tier)."""
    with _running(request.param):
        yield request.param


def _global_clip_runs():
    return _eager_and_jit(CLIPS["clip_by_global_norm"], CLIPS_JIT["clip_by_global_norm"])


# ----------------------------------------------------------------------------------------------
# Strategies: values spread over magnitudes, in fixed shapes.


def base_exponents(lo, hi, p=2.0):
    """log10 magnitudes in ``[lo, hi]``: uniform, or (three times as often) within 0.3 of an end
    of the range or of an edge of the order `p` (`EDGES`), where flushes and overflows happen
    (with a spread of 0.6 or more, an array then straddles the edge)."""
    edges = [e for e in EDGES[p] if lo <= e <= hi]
    near_edge = st.sampled_from([*edges, lo, hi]).flatmap(
        lambda e: st.floats(max(e - 0.3, lo), min(e + 0.3, hi))
    )
    return st.one_of(near_edge, near_edge, near_edge, st.floats(lo, hi))


@st.composite
def magnitude_arrays(draw, shape, dtype_name, nonzero=False, base=None, p=2.0):
    """An array of `shape` whose elements are ``±10**e`` (or ±0 unless `nonzero`), `e` drawn per
    element around a base exponent (`base`, or drawn for the order `p`), with a spread from
    none (one magnitude) to the whole range; every nonzero element is a normal number of the
    dtype."""
    lo, hi = _normal_range(dtype_name)
    if base is None:
        base = draw(base_exponents(lo, hi, p))
    spread = draw(st.sampled_from([0.0, 0.6, 1.0, 5.0, hi - lo]))
    values = []
    for _ in range(math.prod(shape)):
        zero = not nonzero and draw(st.integers(0, 5)) == 0
        exponent = base + (draw(st.floats(-spread, spread)) if spread else 0.0)
        magnitude = 0.0 if zero else 10.0 ** min(max(exponent, lo), hi)
        values.append(-magnitude if draw(st.booleans()) else magnitude)
    return np.asarray(values, np.float64).reshape(shape).astype(DTYPES[dtype_name])


def thresholds(lo=-30.0, hi=30.0, dtype=np.float32):
    """Log-uniform thresholds ``10**e``, rounded to `dtype` (the norm's dtype)."""
    return st.floats(lo, hi).map(lambda e: float(dtype(10.0**e)))


def _tree(draw, shapes, dtype_name, p=2.0):
    """One array (`shapes` a shape) or a list of them, their magnitudes drawn around one base
    exponent for the whole tree or one per leaf."""
    lo, hi = _normal_range(dtype_name)
    base = draw(st.none() | base_exponents(lo, hi, p))
    if isinstance(shapes, tuple):
        return draw(magnitude_arrays(shapes, dtype_name, base=base, p=p))
    return [draw(magnitude_arrays(shape, dtype_name, base=base, p=p)) for shape in shapes]


class NormCase(NamedTuple):
    dtype: str
    ord: float
    kind: str
    tree: object


@st.composite
def norm_cases(draw):
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    p = draw(st.sampled_from([*ORDS, 2.0, 3.0]))  # the orders with edges, twice as often
    kind = draw(st.sampled_from(list(TREE_SHAPES)))
    return NormCase(dtype, p, kind, _tree(draw, TREE_SHAPES[kind], dtype, p))


class ClipCase(NamedTuple):
    tree: list
    c: float


@st.composite
def clip_cases(draw, shapes, dtype="float32"):
    return ClipCase(_tree(draw, shapes, dtype), draw(thresholds()))


@st.composite
def complex_leaves(draw, shapes):
    leaves = []
    for shape in shapes:
        z = np.empty(shape, np.complex64)  # parts set separately: signed zeros are kept
        z.real = draw(magnitude_arrays(shape, "float32"))
        z.imag = draw(magnitude_arrays(shape, "float32"))
        leaves.append(z)
    return leaves


def _property(examples, strategy, check):
    """Runs `check` on `examples` values drawn from `strategy` (hypothesis keeps the failures it
    found per `check`, and replays them first the next time), jitted only in the fast tier."""
    fast = examples <= FAST_EXAMPLES
    run = settings(
        max_examples=examples,
        deadline=None,
        derandomize=False,
        # The fast tier reports a failing example as found; the slow tier shrinks it to a
        # minimal one (shrinking reruns eager code hundreds of times).
        phases=NO_SHRINK if fast else ALL_PHASES,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )(given(strategy)(check))
    with _running(*(("jit",) if fast else ("eager", "jit"))):
        run()


def _ways_run():
    return [how for how, _ in _eager_and_jit(None, None)]


def test_the_fast_tiers_property_tests_run_the_jitted_functions_only():
    """`_property`: the fast tier's examples run each function jitted only, the slow tier's
    eagerly too."""

    def ways(examples):
        seen = set()
        _property(examples, st.just(None), lambda _: seen.add(tuple(_ways_run())))
        return seen

    assert ways(EXAMPLES[0]) == {("jit",)}
    assert ways(EXAMPLES[1]) == {("eager", "jit")}


def test_a_fixed_example_runs_its_functions_the_one_way_of_its_case(way):
    """`way`: jitted in the fast tier, eagerly in the slow tier."""
    assert _ways_run() == [way]


def test_a_check_outside_a_property_test_without_a_way_is_an_error():
    with pytest.raises(RuntimeError, match="without the `way` fixture"):
        _ways_run()


# ----------------------------------------------------------------------------------------------
# Checks.


def _leaves(tree):
    return jax.tree.leaves(tree)


def _bits(x):
    x = np.asarray(x)
    return x.dtype, x.shape, x.tobytes()


def _slice_norms(x, axes=None):
    """float64 2-norms of `x` (exact values) over `axes` (all axes: None), kept as size-1 dims,
    scaled by the largest magnitude first so that nothing overflows or underflows."""
    a = np.abs(as_f64(x))
    m = np.max(a, axis=axes, keepdims=True, initial=0.0)
    safe = np.where(m > 0, m, 1.0)
    return m * np.sqrt(np.sum((a / safe) ** 2, axis=axes, keepdims=True))


def _assert_norm(got, leaves, p, what, rtol=None):
    expected = ref_global_norm(leaves, p)
    got = np.asarray(got)
    assert got.shape == (), f"{what}: not a scalar: {got.shape}"
    if expected > float(jnp.finfo(got.dtype).max) and float(got) == math.inf:
        return  # the norm itself overflows the result's dtype (bfloat16 leaves near their max)
    np.testing.assert_allclose(
        float(got), expected, rtol=rtol or NORM_RTOL[p], atol=0, err_msg=f"{what}: wrong norm"
    )


def _assert_same_bits(out, x, what):
    assert _bits(out) == _bits(x), f"{what}: not the input bit for bit: {out!r} vs {x!r}"


def _representable(values, dtype):
    """float64 `values` with those below `dtype`'s smallest normal magnitude flushed to zero
    (as XLA on CPU does): the closest a result of that dtype can come."""
    tiny = float(jnp.finfo(dtype).smallest_normal)
    if np.iscomplexobj(values):
        return _representable(values.real, dtype) + 1j * _representable(values.imag, dtype)
    return np.where(np.abs(values) < tiny, 0.0, values)


def _assert_clipped_global(outs, xs, c, what):
    """`outs` is ``x * c / max(norm, c)`` of the tree `xs`: within `CLIP_RTOL` of the largest
    expected magnitude (plus the leaf dtype's smallest normal: smaller results flush to zero);
    the input bits at or under the threshold; a tree of norm `c` above it."""
    outs, xs = [np.asarray(x) for x in _leaves(outs)], _leaves(xs)
    assert len(outs) == len(xs), what
    n = ref_global_norm(xs)
    # x / n * c, not x * (c / n): in float64 too, c / n can be below the smallest normal.
    expected = [as_f64(x) if n <= c else as_f64(x) / n * c for x in xs]
    atol = CLIP_RTOL * max((np.max(np.abs(e), initial=0.0) for e in expected), default=0.0)
    for i, (out, x, e) in enumerate(zip(outs, xs, expected)):
        out = np.asarray(out)
        assert out.dtype == np.asarray(x).dtype and out.shape == e.shape, f"{what}: leaf {i}"
        tiny = float(jnp.finfo(out.dtype).smallest_normal)
        np.testing.assert_allclose(
            as_f64(out),
            e,
            rtol=CLIP_RTOL,
            atol=atol + tiny,
            err_msg=f"{what}: leaf {i} (norm {n!r}, threshold {c!r})",
        )
    if n < c * (1 - CLIP_RTOL):
        for out, x in zip(outs, xs):
            _assert_same_bits(out, x, f"{what} under the threshold")
    elif n > c * (1 + CLIP_RTOL):  # norm c, less what the leaf dtypes cannot hold
        kept = [_representable(e, out.dtype) for e, out in zip(expected, outs)]
        tiny = max(float(jnp.finfo(out.dtype).smallest_normal) for out in outs)
        np.testing.assert_allclose(
            ref_global_norm(outs),
            ref_global_norm(kept),
            rtol=CLIP_RTOL,
            atol=tiny * math.sqrt(sum(e.size for e in expected)),
            err_msg=f"{what}: clipped norm (from {n!r}, threshold {c!r})",
        )


def _assert_clipped_slices(outs, xs, c, axes, what):
    """`outs` is each slice (leaf, or rows with ``axes=-1``) of `xs` times ``c / max(norm, c)``,
    as in `_assert_clipped_global` but slice by slice."""
    outs, xs = _leaves(outs), _leaves(xs)
    assert len(outs) == len(xs), what
    norms = [_slice_norms(x, axes) for x in xs]
    expected = [
        np.where(n > c, as_f64(x) / np.where(n > c, n, 1.0) * c, as_f64(x))
        for x, n in zip(xs, norms)
    ]
    atol = CLIP_RTOL * max((np.max(np.abs(e), initial=0.0) for e in expected), default=0.0)
    for i, (out, x, n, e) in enumerate(zip(outs, xs, norms, expected)):
        out, x = np.asarray(out), np.asarray(x)
        assert out.dtype == x.dtype and out.shape == x.shape, f"{what}: leaf {i}"
        tiny = float(jnp.finfo(out.dtype).smallest_normal)
        np.testing.assert_allclose(
            as_f64(out),
            e,
            rtol=CLIP_RTOL,
            atol=atol + tiny,
            err_msg=f"{what}: leaf {i} (norms {n.ravel()!r}, threshold {c!r})",
        )
        under = np.broadcast_to(n < c * (1 - CLIP_RTOL), x.shape)
        assert out[under].tobytes() == x[under].tobytes(), (
            f"{what}: leaf {i}: a slice under the threshold changed: {out!r} vs {x!r}"
        )
        over = n > c * (1 + CLIP_RTOL)  # norm c, less what the dtype cannot hold
        np.testing.assert_allclose(
            _slice_norms(out, axes)[over],
            _slice_norms(_representable(e, out.dtype), axes)[over],
            rtol=CLIP_RTOL,
            atol=tiny * math.sqrt(e.size),
            err_msg=f"{what}: leaf {i}: clipped norms (from {n.ravel()!r}, threshold {c!r})",
        )


def _assert_vjp(got, expected, scale, what):
    """A VJP within `VJP_RTOL` of its float64 value, relative to the larger of its largest
    magnitude and `scale` (the size of the terms it is the sum of: float32 cancels there), plus
    a few times float32's smallest normal (smaller values flush to zero); and finite everywhere."""
    got = as_f64(got)
    expected = np.asarray(expected, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: not finite: {got!r} (expected {expected!r})"
    atol = VJP_RTOL * max(np.max(np.abs(expected), initial=0.0), scale)
    # (terms of the VJP are products of factors near the flush boundary: a term up to a few
    # times the smallest normal can flush in an intermediate product; found by the slow tier)
    atol += 4 * float(jnp.finfo(jnp.float32).smallest_normal)
    np.testing.assert_allclose(got, expected, rtol=VJP_RTOL, atol=atol, err_msg=what)


def _clip_vjp_expected(x, c, g):
    """The float64 VJP of ``x * c / max(||x||, c)`` with cotangent `g`: with respect to `x`
    and to `c`, and the size of the terms the first is summed from."""
    x, g = as_f64(x), as_f64(g)
    n = ref_global_norm([x])
    if n <= c:
        return g, 0.0, float(np.max(np.abs(g), initial=0.0))
    s = c / n
    dot = float(x @ g)
    return s * (g - x * (dot / n**2)), dot / n, s * float(np.max(np.abs(g), initial=0.0))


def _norm_grad_expected(x, p):
    """The float64 gradient of the `p`-norm at `x`: ``sign(x) (|x| / n) ** (p - 1)``; for the
    infinity norm, the sign at the (unique) largest magnitude."""
    x = as_f64(x)
    a = np.abs(x)
    n = ref_global_norm([x], p)
    grad = np.zeros_like(x)
    if n == 0:
        return grad
    if p == math.inf:
        k = int(np.argmax(a))
        grad[k] = np.sign(x[k])
        return grad
    nonzero = a > 0
    grad[nonzero] = np.sign(x[nonzero]) * (a[nonzero] / n) ** (p - 1)
    return grad


# ----------------------------------------------------------------------------------------------
# 1. Norms at every magnitude.


def _log_error(got, expected):
    """log10 of the relative error, the score hypothesis' targeting phase climbs."""
    with np.errstate(over="ignore"):
        got, expected = float(got), float(np.asarray(expected, np.asarray(got).dtype))
    if not math.isfinite(got) or not math.isfinite(expected):
        return -20.0 if got == expected or (math.isnan(got) and math.isnan(expected)) else 0.0
    return math.log10(abs(got - expected) / max(abs(expected), 1e-300) + 1e-20)


def _check_norm_case(case: NormCase):
    leaves = _leaves(case.tree)
    what = f"global_norm(ord={case.ord}) of a {case.dtype} tree '{case.kind}'"
    expected = ref_global_norm(leaves, case.ord)
    results = [
        (how, fn(case.tree)) for how, fn in _eager_and_jit(NORM[case.ord], NORM_JIT[case.ord])
    ]
    target(max(_log_error(got, expected) for _, got in results), label="norm error")
    for how, got in results:
        assert got.dtype == jnp.float32, f"{how} {what}: dtype {got.dtype}"
        _assert_norm(got, leaves, case.ord, f"{how} {what}")


@pytest.mark.parametrize("examples", NORM_EXAMPLES)
def test_global_norm_exact_at_every_magnitude(examples):
    _property(examples, norm_cases(), _check_norm_case)


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("p", ORDS)
@pytest.mark.every_case
def test_global_norm_of_tiny_values(p):
    """Squares (and cubes) of these flush to zero in float32; the norm must not."""
    for values in ([1e-19, 1e-19, 1.2e-19], [1e-19, 2e-19], [1e-30] * 7, [3e-38, 1e-37]):
        x = np.asarray(values, np.float32)
        for how, fn in _eager_and_jit(NORM[p], NORM_JIT[p]):
            _assert_norm(fn(x), [x], p, f"{how} global_norm(ord={p}) of {values}")


@pytest.mark.usefixtures("way")
def test_global_norm_of_tiny_values_example():
    x = np.asarray([1e-19, 1e-19, 1.2e-19], np.float32)
    for how, fn in _eager_and_jit(NORM[2.0], NORM_JIT[2.0]):
        np.testing.assert_allclose(float(fn(x)), 1.8547236e-19, rtol=1e-6, err_msg=how)


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("p", ORDS)
@pytest.mark.every_case
def test_global_norm_of_mixed_extreme_magnitudes(p):
    trees = [
        np.asarray([1e-25, 1e25], np.float32),
        [np.asarray([1e-25, -1e-25, 1e-25], np.float32), np.asarray(1e25, np.float32)],
        [np.asarray([1e-30] * 3, np.float32), np.asarray([[1e-20] * 5] * 2, np.float32)],
        [np.asarray([1e38, -1e37], np.float32), np.asarray([1e-38], np.float32)],
        np.asarray([60000.0, 1e-4, -65504.0], np.float16),
        np.asarray([1e38, 1e-37, -1e37], jnp.bfloat16),
    ]
    for tree in trees:
        for how, fn in _eager_and_jit(NORM[p], NORM_JIT[p]):
            _assert_norm(fn(tree), _leaves(tree), p, f"{how} global_norm(ord={p}) of {tree!r}")


# ----------------------------------------------------------------------------------------------
# 2. Eager and jitted norms are the same bits.


def _check_eager_is_jit(case: NormCase):
    eager = NORM[case.ord](case.tree)
    jitted = NORM_JIT[case.ord](case.tree)
    target(_log_error(eager, jitted), label="eager vs jit")
    assert _bits(eager) == _bits(jitted), (
        f"global_norm(ord={case.ord}) of a {case.dtype} tree '{case.kind}': "
        f"eager {eager!r} vs jit {jitted!r}"
    )


@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
@pytest.mark.parametrize("examples", NORM_EXAMPLES)
def test_eager_and_jit_norms_same_bits(examples):
    _property(examples, norm_cases(), _check_eager_is_jit)


@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
@pytest.mark.parametrize("p", ORDS)
@pytest.mark.every_case
def test_eager_and_jit_norms_same_bits_tiny(p):
    for values in ([1e-19, 2e-19], [1e-19, 1e-19, 1.2e-19], [1e-25, 1e25]):
        x = np.asarray(values, np.float32)
        eager, jitted = NORM[p](x), NORM_JIT[p](x)
        assert _bits(eager) == _bits(jitted), (
            f"global_norm(ord={p}) of {values}: eager {eager!r} vs jit {jitted!r}"
        )


# ----------------------------------------------------------------------------------------------
# 3. Non-finite values.


class NonFiniteCase(NamedTuple):
    ord: float
    fill: float
    size: int
    nan_at: int | None
    inf_at: int | None
    inf_sign: float

    def array(self):
        x = np.full(self.size, self.fill, np.float32)
        if self.inf_at is not None:
            x[self.inf_at] = self.inf_sign * np.inf
        if self.nan_at is not None:
            x[self.nan_at] = np.nan
        return x


@st.composite
def nonfinite_cases(draw):
    size = draw(st.sampled_from([5000, 7]))
    positions = st.sampled_from([0, size - 1, size // 2]) | st.integers(0, size - 1)
    nan_at = draw(st.none() | positions)
    inf_at = draw(positions if nan_at is None else st.none() | positions)
    return NonFiniteCase(
        draw(st.sampled_from([*ORDS, math.inf])),  # the order whose max can drop a NaN, twice
        draw(st.sampled_from([1.5, -1.5, 1e-20, 1e20, 0.0])),
        size,
        nan_at,
        inf_at,
        draw(st.sampled_from([1.0, -1.0])),
    )


def _check_nonfinite(case: NonFiniteCase):
    x = case.array()
    has_nan = bool(np.isnan(x).any())
    for how, fn in _eager_and_jit(NORM[case.ord], NORM_JIT[case.ord]):
        norm = float(fn(x))
        if has_nan:
            assert math.isnan(norm), f"{how} global_norm(ord={case.ord}): {norm}, not NaN"
        else:
            assert norm == math.inf, f"{how} global_norm(ord={case.ord}): {norm}, not inf"
    for how, fn in _eager_and_jit(ZEROING[case.ord], ZEROING_JIT[case.ord]):
        updates, state = fn(x)
        updates = np.asarray(updates)
        assert updates.dtype == np.float32 and np.all(updates == 0), (
            f"{how} global_clip(ord={case.ord}, nonfinite='zero'): update not zero: {updates!r}"
        )
        count = int(state[0].nonfinite_count)
        assert count == 1, f"{how} global_clip(ord={case.ord}): nonfinite_count {count}"


@pytest.mark.parametrize("examples", EXAMPLES)
def test_nonfinite_values_give_nonfinite_norms(examples):
    _property(examples, nonfinite_cases(), _check_nonfinite)


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("nan_at", [0, 2500, 4999])
@pytest.mark.parametrize("with_inf", [False, True])
@pytest.mark.every_case
def test_nan_in_large_array_gives_nan_infinity_norm(nan_at, with_inf):
    case = NonFiniteCase(math.inf, 1.5, 5000, nan_at, 1234 if with_inf else None, 1.0)
    _check_nonfinite(case)


# ----------------------------------------------------------------------------------------------
# 4. Clips at every magnitude.


def _check_global_clip(case: ClipCase):
    for how, fn in _global_clip_runs():
        what = f"{how} clip_by_global_norm"
        clipped, norm = fn(case.tree, case.c)
        _assert_norm(norm, case.tree, 2.0, what)
        _assert_clipped_global(clipped, case.tree, case.c, what)


@pytest.mark.parametrize("examples", MORE_EXAMPLES)
def test_clip_by_global_norm_at_every_magnitude(examples):
    _property(examples, clip_cases(CLIP_SHAPES), _check_global_clip)


class SliceCase(NamedTuple):
    rows: bool
    tree: list
    c: float


@st.composite
def slice_cases(draw):
    rows = draw(st.booleans())
    return SliceCase(rows, *draw(clip_cases(ROW_SHAPES if rows else CLIP_SHAPES)))


def _check_slice_clip(case: SliceCase):
    if case.rows:
        fns, axes = _eager_and_jit(_clip_rows, ROW_CLIP_JIT), -1
    else:
        fns, axes = _eager_and_jit(_clip_leaves, CLIPS_JIT["clip_by_norm"]), None
    for how, fn in fns:
        what = f"{how} clip_by_norm(axes={axes})"
        _assert_clipped_slices(fn(case.tree, case.c), case.tree, case.c, axes, what)


@pytest.mark.parametrize("examples", MORE_EXAMPLES)
def test_clip_by_norm_at_every_magnitude(examples):
    _property(examples, slice_cases(), _check_slice_clip)


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize(
    ("values", "c"),
    [
        ([1e10, 1.0], 1e-30),  # c / norm is below float32's smallest normal
        ([3e30, -4e30], 1e-29),
        ([1e-20, 1e-20, 3e-20], 1e-21),  # every square flushes to zero
        ([1e-20, -2e-20], 1e-19),  # under the threshold: unchanged
        ([1e-30, 1e30], 1e-30),
        ([1e-25, 1e25, 0.0], 1e20),
    ],
)
@pytest.mark.every_case
def test_clips_of_extreme_examples(values, c):
    c = float(np.float32(c))
    x = np.asarray(values, np.float32)
    _check_global_clip(ClipCase([x], c))
    _check_slice_clip(SliceCase(False, [x], c))
    _check_slice_clip(SliceCase(True, [np.stack([x, x / 4])], c))


# ----------------------------------------------------------------------------------------------
# 5. Complex leaves.


class ComplexCase(NamedTuple):
    ord: float
    tree: list
    c: float


@st.composite
def complex_cases(draw):
    return ComplexCase(
        draw(st.sampled_from(ORDS)), draw(complex_leaves(COMPLEX_SHAPES)), draw(thresholds())
    )


def _check_complex(case: ComplexCase):
    leaves = case.tree
    for how, fn in _eager_and_jit(NORM[case.ord], NORM_JIT[case.ord]):
        _assert_norm(fn(leaves), leaves, case.ord, f"{how} complex global_norm(ord={case.ord})")
    for name in CLIPS:
        for how, fn in _eager_and_jit(CLIPS[name], CLIPS_JIT[name]):
            out = fn(leaves, case.c)
            if name == "clip_by_global_norm":
                _assert_clipped_global(out[0], leaves, case.c, f"{how} complex {name}")
            else:
                _assert_clipped_slices(out, leaves, case.c, None, f"{how} complex {name}")
    for how, fn in _eager_and_jit(_global_clip_step, GLOBAL_CLIP_STEP_JIT):
        updates, state = fn(leaves, case.c)
        _assert_clipped_global(updates, leaves, case.c, f"{how} complex global_clip")
        _assert_norm(state.global_norm, leaves, 2.0, f"{how} complex global_clip state")


@pytest.mark.parametrize("examples", EXAMPLES)
def test_complex_leaves_at_every_magnitude(examples):
    _property(examples, complex_cases(), _check_complex)


def test_complex_leaf_under_threshold_keeps_signed_zeros():
    z = np.empty(4, np.complex64)
    z.real = [1.0, -0.0, 2.0, 0.0]
    z.imag = [-0.0, -0.0, 3.0, -0.0]
    tree = [z, np.asarray([3e-20 - 0j, 1e-30 + 1e-30j], np.complex64)]
    tree[1].imag[0] = -0.0
    runs = [
        ("clip_by_global_norm", lambda t: _clip_global_tree(t, 10.0)[0]),
        ("clip_by_global_norm jit", lambda t: CLIPS_JIT["clip_by_global_norm"](t, 10.0)[0]),
        ("clip_by_norm", lambda t: _clip_leaves(t, 10.0)),
        ("clip_by_norm jit", lambda t: CLIPS_JIT["clip_by_norm"](t, 10.0)),
        ("global_clip", lambda t: _global_clip_step(t, 10.0)[0]),
        ("global_clip jit", lambda t: GLOBAL_CLIP_STEP_JIT(t, 10.0)[0]),
    ]
    for what, fn in runs:
        out = fn(tree)
        for leaf, x in zip(out, tree):
            leaf = np.asarray(leaf)
            np.testing.assert_array_equal(
                np.signbit(leaf.imag), np.signbit(x.imag), err_msg=f"{what}: imaginary sign"
            )
            np.testing.assert_array_equal(
                np.signbit(leaf.real), np.signbit(x.real), err_msg=f"{what}: real sign"
            )
            _assert_same_bits(leaf, x, what)


# ----------------------------------------------------------------------------------------------
# 6. float64 and float32 leaves together (x64).


def _x64_tree(a, b):
    return {"a": jnp.asarray(a[0], a[1]), "b": jnp.asarray(b[0], b[1])}


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (([1e-200], jnp.float64), ([0.0], jnp.float32), 1e-200),
        (([1.0], jnp.float64), ([1e38], jnp.float32), float(np.float32(1e38))),
        (([1e-20], jnp.float64), ([1e-20], jnp.float32), 1.4142135e-20),
    ],
    ids=["tiny-f64-zero-f32", "one-f64-huge-f32", "tiny-both"],
)
@pytest.mark.every_case
def test_x64_mixed_trees(a, b, expected):
    with jax.enable_x64(True):
        tree = _x64_tree(a, b)
        leaves = _leaves(tree)
        np.testing.assert_allclose(ref_global_norm(leaves), expected, rtol=1e-6)
        for how, fn in _eager_and_jit(NORM[2.0], NORM_JIT[2.0]):
            norm = fn(tree)
            assert norm.dtype == jnp.float64, f"{how}: {norm.dtype}"
            np.testing.assert_allclose(float(norm), expected, rtol=1e-6, err_msg=how)
        for c in (1.0, expected * 1e-5, expected * 1e5):
            for how, fn in _global_clip_runs():
                clipped, norm = fn(tree, c)
                for leaf in _leaves(clipped):
                    assert not np.isnan(np.asarray(leaf)).any(), f"{how}, c={c}: NaN: {clipped}"
                _assert_norm(norm, leaves, 2.0, f"{how} clip_by_global_norm, c={c}")
                _assert_clipped_global(clipped, leaves, c, f"{how} clip_by_global_norm, c={c}")


class X64Case(NamedTuple):
    ord: float
    tree: dict
    c: float


@st.composite
def x64_cases(draw):
    tree = {
        "a": draw(magnitude_arrays((3,), "float64")),
        "b": draw(magnitude_arrays((2, 2), "float32")),
        "c": draw(magnitude_arrays((), "float64")),
    }
    return X64Case(draw(st.sampled_from(ORDS)), tree, draw(thresholds(-300.0, 300.0, np.float64)))


def _check_x64(case: X64Case):
    with jax.enable_x64(True):
        tree = {k: jnp.asarray(v) for k, v in case.tree.items()}
        assert tree["a"].dtype == jnp.float64 and tree["b"].dtype == jnp.float32
        leaves = [np.asarray(x) for x in _leaves(tree)]
        for how, fn in _eager_and_jit(NORM[case.ord], NORM_JIT[case.ord]):
            norm = fn(tree)
            assert norm.dtype == jnp.float64, f"{how}: {norm.dtype}"
            _assert_norm(norm, leaves, case.ord, f"{how} x64 global_norm(ord={case.ord})", 1e-6)
        for how, fn in _global_clip_runs():
            clipped, norm = fn(tree, case.c)
            what = f"{how} x64 clip_by_global_norm"
            _assert_norm(norm, leaves, 2.0, what, 1e-6)
            _assert_clipped_global(clipped, leaves, case.c, what)


@pytest.mark.parametrize("examples", EXAMPLES)
def test_x64_mixed_trees_at_every_magnitude(examples):
    _property(examples, x64_cases(), _check_x64)


# ----------------------------------------------------------------------------------------------
# 7. Gradients.


class ClipVjpCase(NamedTuple):
    clip: str
    x: np.ndarray
    c: float
    g: np.ndarray


@st.composite
def clip_vjp_cases(draw):
    x = draw(magnitude_arrays((VJP_SIZE,), "float32"))
    c = draw(thresholds())
    n = ref_global_norm([x])
    assume(abs(n / c - 1) > 1e-3)  # away from the kink at norm == threshold
    g = draw(hnp.arrays(np.float32, (VJP_SIZE,), elements=COTANGENT_ELEMENTS))
    return ClipVjpCase(draw(st.sampled_from(list(CLIP_VJP))), x, c, g)


def _check_clip_vjp(case: ClipVjpCase):
    dx_expected, dc_expected, scale = _clip_vjp_expected(case.x, case.c, case.g)
    c = np.float32(case.c)
    for how, fn in _eager_and_jit(CLIP_VJP[case.clip], CLIP_VJP_JIT[case.clip]):
        dx, dc = fn(case.x, c, case.g)
        what = f"{how} vjp of {case.clip}"
        _assert_vjp(dx, dx_expected, scale, f"{what} with respect to x")
        g_size = float(np.max(np.abs(as_f64(case.g)), initial=0.0))
        _assert_vjp(dc, dc_expected, g_size, f"{what} with respect to the threshold")


@pytest.mark.parametrize("examples", EXAMPLES)
def test_clip_vjps_at_every_magnitude(examples):
    _property(examples, clip_vjp_cases(), _check_clip_vjp)


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("clip", list(CLIP_VJP))
def test_clip_vjp_where_x_dot_g_flushes(clip):
    """The slow tier's property test found this (clip 1e-20, a norm of 1e-19): ``x . g`` is
    ~6e-47, below float32's range, and JAX's own rule, which forms it, loses the projection
    term (the last entry was 0.1 g where it cancels to 0)."""
    g = np.full(5, 5.9149257e-28, np.float32)
    x = np.asarray([0.0, 0.0, 0.0, 0.0, 1e-19], np.float32)
    _check_clip_vjp(ClipVjpCase(clip, x, 9.999999682655225e-21, g))


@pytest.mark.parametrize("c", [1.0, 10.0], ids=["over", "under"])
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_the_clips_derivative_with_a_loss_scale_factor(c, mode):
    """The clip's own rule (`_scale.clip_leaves`) in every argument, the loss scale's inverse
    included (``x * k * c / max(n, c)``, the norm computed from `x`), against float64:
    ``k s (I - u u^T)`` in `x`, ``k u`` in the threshold and ``s x`` in the factor."""
    x = np.asarray([3.0, -4.0, 1.0, 0.5], np.float32)
    k = 0.5

    def clip(x, c, k):
        return _scale.clip_leaves([x], optclip.global_norm(x), c, k)[0]

    jacobian = jax.jacfwd if mode == "forward" else jax.jacrev
    dx, dc, dk = jacobian(clip, argnums=(0, 1, 2))(x, np.float32(c), np.float32(k))
    x64 = as_f64(x)
    n = float(np.linalg.norm(x64))
    u = x64 / n
    over = n > c
    s = c / n if over else 1.0
    want_dx = k * s * (np.eye(4) - np.outer(u, u)) if over else k * np.eye(4)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dc, k * u if over else np.zeros(4), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dk, s * x64, rtol=1e-6)


class NormVjpCase(NamedTuple):
    ord: float
    x: np.ndarray
    g: float


@st.composite
def norm_vjp_cases(draw):
    p = draw(st.sampled_from(ORDS))
    x = draw(magnitude_arrays((VJP_SIZE,), "float32", nonzero=p < 1, p=p))
    if p == math.inf:  # differentiable where the largest magnitude is unique
        top = np.sort(np.abs(x))
        assume(top[-1] > top[-2])
    g = draw(st.floats(0.5, 2.0, width=32)) * draw(st.sampled_from([1.0, -1.0]))
    return NormVjpCase(p, x, g)


def _check_norm_vjp(case: NormVjpCase):
    expected = case.g * _norm_grad_expected(case.x, case.ord)
    g = np.float32(case.g)
    for how, fn in _eager_and_jit(NORM_VJP[case.ord], NORM_VJP_JIT[case.ord]):
        _assert_vjp(fn(case.x, g), expected, 0.0, f"{how} gradient of global_norm(ord={case.ord})")


@pytest.mark.parametrize("examples", EXAMPLES)
def test_norm_vjps_at_every_magnitude(examples):
    _property(examples, norm_vjp_cases(), _check_norm_vjp)


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("clip", list(CLIP_VJP))
@pytest.mark.every_case
def test_clip_vjp_at_large_magnitudes(clip):
    x, g = np.asarray([3e19, 4e19], np.float32), np.asarray([1.0, 2.0], np.float32)
    for how, fn in _eager_and_jit(CLIP_VJP[clip], CLIP_VJP_JIT[clip]):
        dx, dc = fn(x, np.float32(1e19), g)
        _assert_vjp(dx, [-0.064, 0.048], 0.4, f"{how} vjp of {clip} with respect to x")
        _assert_vjp(dc, 2.2, 2.0, f"{how} vjp of {clip} with respect to the threshold")


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize("clip", list(CLIP_VJP))
@pytest.mark.every_case
def test_clip_vjp_of_small_values(clip):
    """Norms whose squares flush to zero, over a zero or tiny threshold: finite gradients."""
    cases = [
        # (x, c, g, dx, dc or None): at c = 0 the primal is 0 and d/dx is (0 / n)(...) = 0.
        ([1e-20, 1e-20], 0.0, [1.0, 2.0], [0.0, 0.0], None),
        ([4e-21], 1e-23, [1.0], [0.0], 1.0),
        ([3.0, 4.0], 1.0, [1.0, 1.0], [0.032, -0.024], 1.4),
    ]
    for values, c, cotangent, dx_expected, dc_expected in cases:
        x, g = np.asarray(values, np.float32), np.asarray(cotangent, np.float32)
        for how, fn in _eager_and_jit(CLIP_VJP[clip], CLIP_VJP_JIT[clip]):
            what = f"{how} vjp of {clip} at x={values}, c={c}"
            dx, dc = fn(x, np.float32(c), g)
            _assert_vjp(dx, dx_expected, float(np.float32(c)) / ref_global_norm([x]), what)
            if dc_expected is None:
                assert np.isfinite(float(dc)), f"{what}: threshold gradient {dc}"
            else:
                _assert_vjp(dc, dc_expected, 1.0, f"{what}, with respect to the threshold")
        if c == 0:
            primal = jax.jit(_global_clip_update)(x, 0.0) if clip == "global_clip" else None
            primal = CLIPS_JIT[clip](x, 0.0) if primal is None else primal
            primal = primal[0] if clip == "clip_by_global_norm" else primal
            assert np.all(np.asarray(primal) == 0), f"{clip} at threshold 0: {primal}"


@pytest.mark.usefixtures("way")
@pytest.mark.parametrize(
    ("p", "values", "expected"),
    [
        (1.0, [1.0, 3e38], [1.0, 1.0]),
        (0.5, [1.0, 1e30], [1e15 + 1, 1.0 + 1e-15]),
        (2.0, [3e19, -4e19], [0.6, -0.8]),
        (2.0, [3e-20, -4e-20], [0.6, -0.8]),
        (3.0, [1e-15, 1e-15], [2 ** (-2 / 3)] * 2),
    ],
)
@pytest.mark.every_case
def test_norm_gradient_examples(p, values, expected):
    x = np.asarray(values, np.float32)
    np.testing.assert_allclose(_norm_grad_expected(x, p), expected, rtol=1e-6)
    for how, fn in _eager_and_jit(NORM_VJP[p], NORM_VJP_JIT[p]):
        grad = fn(x, np.float32(1.0))
        _assert_vjp(grad, expected, 0.0, f"{how} gradient of global_norm(ord={p}) at {values}")


# ----------------------------------------------------------------------------------------------
# 8. The transformation agrees with the functions.


@st.composite
def consistency_cases(draw):
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return ClipCase(_tree(draw, TREE_SHAPES["few"], dtype), draw(thresholds()))


def _check_consistency(case: ClipCase):
    updates, state = GLOBAL_CLIP_STEP_JIT(case.tree, case.c)
    clipped, norm = CLIPS_JIT["clip_by_global_norm"](case.tree, case.c)
    for i, (u, x) in enumerate(zip(updates, clipped)):
        assert _bits(u) == _bits(x), f"leaf {i}: global_clip {u!r} vs clip_by_global_norm {x!r}"
    reference = NORM_JIT[2.0](case.tree)
    assert _bits(state.global_norm) == _bits(reference), (
        f"state.global_norm {state.global_norm!r} vs global_norm {reference!r}"
    )
    assert _bits(norm) == _bits(reference), f"clip_by_global_norm's norm {norm!r}"


@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
@pytest.mark.parametrize("examples", EXAMPLES)
def test_global_clip_matches_functions(examples):
    _property(examples, consistency_cases(), _check_consistency)
