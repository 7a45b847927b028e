"""Invariants of the clips, checked on generated inputs (hypothesis)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import as_f64, ref_global_norm

import optclip

SHAPES = [(3,), (2, 4)]
finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)
trees = st.tuples(*[hnp.arrays(np.float32, s, elements=finite) for s in SHAPES])
thresholds = st.floats(0.125, 8192.0, width=32)

global_clip_fn = jax.jit(lambda t, c: optclip.clip_by_global_norm(t, c))
norm_clip_fn = jax.jit(lambda t, c: optclip.clip_by_norm(t, c))
row_clip_fn = jax.jit(lambda t, c: optclip.clip_by_norm(t, c, axes=-1))
settings.register_profile("optclip", max_examples=40, deadline=None)
settings.load_profile("optclip")


def _f64(tree):
    return [as_f64(x) for x in tree]


@given(trees, thresholds)
def test_global_clip_norm_at_most_threshold_and_direction_kept(tree, c):
    clipped, norm = global_clip_fn(tree, c)
    out, x = _f64(clipped), _f64(tree)
    out_norm = ref_global_norm(out)
    assert out_norm <= c * (1 + 1e-6)
    ref = ref_global_norm(x)
    np.testing.assert_allclose(float(norm), ref, rtol=1e-6, atol=1e-30)
    if ref > c:  # scaled by one factor: same direction, norm exactly the threshold
        np.testing.assert_allclose(out_norm, c, rtol=1e-6)
        for a, b in zip(out, x):
            np.testing.assert_allclose(a, b * (c / ref), rtol=1e-6, atol=1e-6 * c)
    else:  # identity, bit for bit
        for a, b in zip(clipped, tree):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@given(trees, thresholds)
def test_clips_are_idempotent(tree, c):
    once, _ = global_clip_fn(tree, c)
    twice, _ = global_clip_fn(once, c)
    for a, b in zip(once, twice):
        np.testing.assert_allclose(as_f64(a), as_f64(b), rtol=1e-6, atol=1e-6 * c)
    for fn in (norm_clip_fn, row_clip_fn):
        once = fn(tree, c)
        twice = fn(once, c)
        for a, b in zip(once, twice):
            np.testing.assert_allclose(as_f64(a), as_f64(b), rtol=1e-6, atol=1e-6 * c)


@given(trees, thresholds)
def test_per_leaf_and_per_row_norms_at_most_threshold(tree, c):
    for out in norm_clip_fn(tree, c):
        assert np.linalg.norm(as_f64(out)) <= c * (1 + 1e-6)
    for out in row_clip_fn(tree, c):
        rows = np.linalg.norm(as_f64(out), axis=-1)
        assert np.all(rows <= c * (1 + 1e-6))


@given(
    st.tuples(
        *[hnp.arrays(np.float16, s, elements=st.floats(-6e4, 6e4, width=16)) for s in SHAPES]
    ),
    st.floats(0.0625, 1024.0, width=32),
)
def test_float16_never_overflows_and_keeps_dtype(tree, c):
    tree = tuple(jnp.asarray(x) for x in tree)
    clipped, norm = global_clip_fn(tree, c)
    assert np.isfinite(float(norm))
    np.testing.assert_allclose(float(norm), ref_global_norm(tree), rtol=1e-6)
    for a in clipped:
        assert a.dtype == jnp.float16
        assert np.all(np.isfinite(as_f64(a)))
    assert ref_global_norm(clipped) <= c * (1 + 2e-3)
