"""`clipped_grad` (ghost clipping): per-example norms and clipped sums against a float64
reference built from materialised per-example gradients, for every layer kind, the fallback,
tied parameters and scanned blocks; padding, zero and non-finite examples; low precision;
what goes ghost; and the arguments' checks."""

import functools
import inspect
import re

import ghost_models as gm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _workers import launch
from ghost_models import RTOL, assert_tree_close
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from reference import equations, run

import optclip

MODELS = {
    "mlp": gm.mlp,
    "sequence": gm.sequence,
    "embedding": gm.embedding,
    "tied": lambda rng: gm.embedding(rng, tied=True),
    "fallback": gm.fallback,
    "scanned": gm.scanned,
    "remat": lambda rng: gm.scanned(rng, remat=True),
    "recurrent": gm.recurrent,
    "sliced": gm.sliced,
    "transformer": gm.transformer,
    "conv": gm.conv,
    "conv_shared": gm.conv_shared,
}


def check_against_reference(
    loss,
    params,
    x,
    clip,
    method="auto",
    mode="jit",
    norm_floor=0.0,
    whole=False,
    traced=None,
    **kwargs,
):
    """`clipped_grad`'s norms and sum against the float64 reference: norms within `RTOL` of
    each (plus `norm_floor` times the largest), the sum's leaves within `RTOL` of their
    largest entry (of the whole sum's, with `whole`). With a `traced` number, ``loss(s)`` is
    the loss, `s` an argument of the jitted step (traced), `traced` the reference's."""
    clipped = lambda f: optclip.clipped_grad(  # noqa: E731
        f, l2_clip_norm=clip, return_grad_norms=True, method=method
    )
    if traced is None:
        grads, aux = run(clipped(loss), mode)(params, x, **kwargs)
    else:
        step = lambda p, x, s: clipped(loss(s))(p, x, **kwargs)  # noqa: E731
        grads, aux = jax.jit(step)(params, x, jnp.float32(traced))
        loss = loss(traced)
    norms, sums = gm.reference(loss, params, x, clip, kwargs.get("is_padding_example"))
    atol = norm_floor * np.max(norms)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL, atol=atol)
    assert_tree_close(grads, sums, whole=whole)
    return grads, aux


@functools.cache
def cached_model(name, seed):
    """`MODELS[name]` drawn from `seed`, and its float64 per-example gradients
    (`gm.per_example_grads`): built once for every test that checks it."""
    loss, params, x = MODELS[name](np.random.default_rng(seed))
    return loss, params, x, gm.per_example_grads(loss, params, x)


def magnitude_step(loss, clip, mode="jit", **kwargs):
    """``step(params, x, magnitude, **more)``: `clipped_grad`'s (`kwargs` its options) sums and
    norms of the loss times `magnitude`, an argument (jitted: one program for ordinary
    magnitudes and those whose squares overflow, and for every batch of one shape; `more`:
    the step's keyword arguments, such as ``is_padding_example``)."""

    def step(params, x, magnitude, **more):
        scaled = lambda p, x, **more: loss(p, x, **more) * magnitude  # noqa: E731
        g = optclip.clipped_grad(scaled, l2_clip_norm=clip, return_grad_norms=True, **kwargs)
        return g(params, x, **more)

    return run(step, mode)


def check_against_grads(result, grads64, clip, **kwargs):
    """A step's ``(sums, aux)`` against `gm.reference_from` (`kwargs`: its padding, magnitude,
    examples kept), to `check_against_reference`'s tolerances."""
    norms, sums = gm.reference_from(grads64, clip, **kwargs)
    np.testing.assert_allclose(np.asarray(result[1].grad_norms), norms, rtol=RTOL)
    assert_tree_close(result[0], sums)


# The fast tier's models: dense, tied embeddings, the fallback, shared weights across scan
# steps (nested), convolutions (plain; grouped, a kernel used twice, stacked under a scan).
# Stacked blocks with sliced q/k/v run in the slow tier (Equinox's and Flax's transformers run
# in the fast one). Every model at every threshold: the slow tier, below.
@pytest.mark.every_case
@pytest.mark.parametrize(
    "name",
    [
        "mlp",
        "tied",
        "fallback",
        "recurrent",
        pytest.param("transformer", marks=pytest.mark.slow),
        "conv",
        "conv_shared",
    ],
)
def test_each_layer_kind_matches_the_float64_reference(name):
    loss, params, x = MODELS[name](np.random.default_rng(0))
    check_against_reference(loss, params, x, 1.0)


# The ghost engine jitted at three thresholds, one program (the threshold its argument); the
# materialising way (`per_example_clip`'s own tests cover its thresholds) and each way eagerly
# (its own compiled program, `_eager`) at one. The float64 gradients: once per model and process.
@pytest.mark.parametrize(
    ("method", "mode"), [("auto", "jit"), ("vmap", "jit"), ("vmap", "eager"), ("auto", "eager")]
)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_method_and_threshold(name, method, mode):
    loss, params, x, grads64 = cached_model(name, 1)
    if (method, mode) == ("auto", "jit"):
        clipped = lambda p, x, c: optclip.clipped_grad(  # noqa: E731
            loss, l2_clip_norm=c, return_grad_norms=True
        )(p, x)
        step = jax.jit(clipped)
        for clip in (0.3, 1e6, 0.0):
            check_against_grads(step(params, x, np.float32(clip)), grads64, clip)
        return
    g = optclip.clipped_grad(loss, l2_clip_norm=0.3, return_grad_norms=True, method=method)
    check_against_grads(run(g, mode)(params, x), grads64, 0.3)


@pytest.mark.parametrize("mode", ["jit", pytest.param("eager", marks=pytest.mark.slow)])
def test_weights_the_same_at_every_step_of_nested_scans_match_the_float64_reference(mode):
    """A kernel and a weight the same at every step of two nested scans (each one product over
    every step's rows, `_sums._constants_merged`) beside a weight the inner scan slices: the
    norms and sums of the float64 reference, some examples clipped, one padding."""
    loss, params, x = gm.nested_constants(np.random.default_rng(3))
    report = optclip.ghost_report(loss, params, x)
    assert {r.mode for r in report.values()} == {"ghost"}, report
    norms, _ = gm.reference(loss, params, x, 1.0)
    clip = float(np.median(norms))
    padding = np.arange(x.shape[0]) == 1
    check_against_reference(loss, params, x, clip, mode=mode, is_padding_example=padding)


@pytest.mark.parametrize("magnitude", [1e22, 1e-24])
def test_norms_exact_at_magnitudes_whose_squares_overflow_or_flush(magnitude):
    # Dense layers and an embedding, whose closed forms multiply four factors: output
    # gradients of that magnitude, then layer inputs of that magnitude. Beside a parameter the
    # loss does not use (its zero set the scale of the others' sum: every norm of 1e-24
    # flushed to 0).
    loss, embedding, ids = gm.embedding(np.random.default_rng(2))
    scaled = lambda p, i: loss(p, i) * magnitude  # noqa: E731
    _, dense, x = gm.mlp(np.random.default_rng(2))
    linear = lambda p, x: jnp.sum(jnp.sin(x @ p["w1"] * (1 / magnitude)) @ p["w2"])  # noqa: E731
    unused = {"unused": jnp.ones(3)}
    for f, params, batch in ((scaled, embedding, ids), (linear, dense, x * magnitude)):
        grads64 = gm.per_example_grads(f, {**params, **unused}, batch)  # (one for both)
        for p in (params, {**params, **unused}):
            g = optclip.clipped_grad(f, l2_clip_norm=1.0, return_grad_norms=True)
            check_against_grads(jax.jit(g)(p, batch), {k: grads64[k] for k in p}, 1.0)


def _zero_norm_models():
    """Beside a dense layer `u` whose per-example norms (about 1e-22) have squares that flush,
    a leaf whose per-example norm is exactly 0 with factors far from 1: ``{name: (loss,
    params)}``."""
    rng = np.random.default_rng(2)
    tiny = lambda p, x: jnp.sum(jnp.sin(x @ p["u"]))  # noqa: E731
    big = jnp.asarray([[1e10] * 4, [-1e10] * 4], jnp.float32)  # (two opposite rows)
    u = {"u": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    return {
        "unused": (tiny, {**u, "w": jnp.ones((4, 3))}),
        "scaled by 0": (
            lambda p, x: tiny(p, x) + jnp.sum(jnp.sin(big @ (p["w"] * 0.0))),
            {**u, "w": jnp.full((4, 3), 1e10, jnp.float32)},
        ),
        "rows that cancel": (  # (its gradient, sum of the rows times 1, is exactly 0)
            lambda p, x: tiny(p, x) + jnp.sum((big + 0 * jnp.sum(x)) @ p["w"]),
            {**u, "w": jnp.ones((4, 3))},
        ),
    }


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name", list(_zero_norm_models()))
def test_a_zero_norm_sets_no_scale_for_the_others(name, mode):
    # Norms are added as ``(exponent, value)`` at the largest exponent. A leaf's zero norm
    # came with an exponent of 0 (unused) or of its large factors (scaled by 0, rows that
    # cancel), which set the scale of the sum: every norm of 1e-22 flushed to 0.
    loss, params = _zero_norm_models()[name]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 2, 4)) * 1e-22, jnp.float32)
    check_against_reference(loss, params, x, 1.0, mode=mode)


def on_platform(jaxpr, platform, scanned=False):
    """``(equation, inside a scan)`` of every equation of `jaxpr` and the jaxprs inside it that
    runs on `platform`: of a `lax.platform_dependent` (a `cond` whose branches name platforms,
    fixed when the step is lowered) only that platform's branch, and not the `cond` itself."""
    for eqn in jaxpr.eqns:
        inner = list(jax.extend.core.jaxprs_in_params(eqn.params))
        chosen = eqn.params.get("branches_platforms")
        if eqn.primitive.name == "cond" and chosen is not None:
            match = [i for i, p in enumerate(chosen) if p and platform in p]
            inner = [inner[(match or [chosen.index(None)])[0]]]
        else:
            yield eqn, scanned
        for sub in inner:
            yield from on_platform(sub, platform, scanned or eqn.primitive.name == "scan")


def test_a_dropped_non_finite_example_leaves_the_others_sums_exact(mode):
    """An example whose gradient is not finite, dropped by ``nan_safe``: its norm is NaN and
    the clipped sums are the float64 reference's over the other examples, jitted and eager
    (its records and output gradients are zeroed, never multiplied by its factor 0)."""
    loss, params, x = gm.mlp(np.random.default_rng(34), h=7)
    step = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    bad = x.at[1, 0].set(np.inf)
    kept = np.delete(np.arange(x.shape[0]), 1)
    _, sums = gm.reference(loss, params, x[kept], 1.0)
    grads, aux = run(step, mode)(params, bad)
    assert not np.isfinite(aux.grad_norms[1])
    assert_tree_close(grads, sums)


@pytest.mark.parametrize("rows", [1, 3])
def test_norms_exact_for_factors_near_float32s_largest(rows, mode):
    # Layer inputs past 2**126 (dividing them by their power of two at once would divide by a
    # subnormal number, which the CPU flushes to zero: norms of 0, the examples unclipped),
    # output gradients small enough for the gradients and norms to be finite: one row per
    # example (inner products) and three (the Grams); the bias's per-example gradients are
    # materialised.
    rng = np.random.default_rng(31)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 3)) * 1e-37, jnp.float32),
        "b": jnp.asarray(rng.normal(size=3), jnp.float32),
    }
    x = rng.normal(size=(5, rows, 4))
    x = jnp.asarray(x / np.max(np.abs(x)) * 2e38, jnp.float32)
    assert np.max(np.abs(x)) > 2.0**126

    def loss(p, x):
        return 1e-4 * jnp.sum(jnp.sin(x @ p["w"] + p["b"]))

    _, aux = check_against_reference(loss, params, x, 1e36, mode=mode)
    assert np.all(np.asarray(aux.grad_norms) > 1e34)
    # Clipped to 1: each example's factor (1e-34) times its output gradients (1e-4) would
    # flush; the output gradients are held divided by a power of two (`scaled`). The bias's
    # clipped sum is at float32's smallest normal numbers (not compared).
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    grads, clipped = run(g, mode)(params, x)
    np.testing.assert_array_equal(clipped.grad_norms, aux.grad_norms)
    _, sums = gm.reference(loss, params, x, 1.0)
    assert_tree_close(grads["w"], sums["w"])
    assert np.max(np.abs(sums["b"])) < 2.0**-124


def _large_inputs(rows, shift=100, dtype=jnp.float32, gain=1e-4):
    """A dense layer whose inputs are ``2**shift`` times larger and output gradients as many
    times smaller than its neighbours' (the per-example gradients are ~`gain` whatever
    `shift`), and a bias."""
    rng = np.random.default_rng(35)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 3)) * 0.5, dtype),
        "b": jnp.asarray(rng.normal(size=3), dtype),
    }
    x = jnp.asarray(rng.normal(size=(5, rows, 4)), dtype)

    def loss(p, x):
        scale = 2.0**shift
        return gain * jnp.sum(jnp.sin((x * scale) @ p["w"] / scale + p["b"]))

    return loss, params, x


def _scanned_large_inputs():
    """Two dense layers under `lax.scan`, the second's inputs at 2**100 and output gradients
    at 2**-100 (the first's at 1): its per-example gradients are as large as the first's."""
    rng = np.random.default_rng(36)
    params = {"w": jnp.asarray(rng.normal(size=(2, 4, 4)) * 0.5, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(5, 1, 4)), jnp.float32)

    def loss(p, x):
        def layer(h, ws):
            w, scale = ws
            return jnp.sin((h * scale) @ w / scale), None

        h, _ = lax.scan(layer, x, (p["w"], jnp.asarray([1.0, 2.0**100], jnp.float32)))
        return 1e-4 * jnp.sum(h)

    return loss, params, x


@pytest.mark.parametrize("model", ["one row", "three rows", "scanned layers"])
def test_clipped_sums_exact_where_a_weighted_side_would_flush(model, monkeypatch):
    """Book-keeping weights one side of each dense product by the example's factor. With
    inputs at 2**100 and output gradients at 1e-34, clipped from ~1e-4 to 1e-10, the weighted
    output gradients (1e-40) would flush: every example's terms were lost, the weight's sum
    0. The records and output gradients are held divided by powers of two (`_interpret.scaled`)
    and each factor carries them: jitted, eager, and as off a CPU. In a scan,
    each layer counts: the second's output gradients are 2**100 times below the first's."""
    if model == "scanned layers":
        loss, params, x = _scanned_large_inputs()
    else:
        loss, params, x = _large_inputs(1 if model == "one row" else 3)
    norms, sums = gm.reference(loss, params, x, 1e-10)
    assert np.all(norms > 1e-6)
    for way in ("jit", "eager", "default"):
        with monkeypatch.context() as m:
            if way == "default":
                gm.take_gpu_branches(m)
            g = optclip.clipped_grad(loss, l2_clip_norm=1e-10, return_grad_norms=True)
            grads, aux = run(g, "eager" if way == "eager" else "jit")(params, x)
        np.testing.assert_allclose(aux.grad_norms, norms, rtol=RTOL)
        assert_tree_close(grads, sums)


def test_unit_norm_factor_of_a_zero_gradient_beside_large_inputs_is_not_nan(monkeypatch):
    """With `rescale_to_unit_norm`, an example whose gradient is 0 has factor ``1 / c``. Its
    second layer's inputs (1e10) weighted by it (1e35) overflowed, and inf times its output
    gradients (0: the ReLU is off) made every leaf's sum NaN. The other example's norm
    (3e-29, whose squares flush: method="vmap" takes it for 0) is clipped to 1e-35."""

    def loss(p, x):
        z = (x @ p["w1"]) @ p["w2"]
        return 1e-20 * jnp.sum(jax.nn.relu(z) * p["v"])

    params = {
        "w1": jnp.eye(3, dtype=jnp.float32),
        "w2": jnp.ones((3, 4), jnp.float32),
        "v": jnp.ones((4,), jnp.float32),
    }
    x = jnp.asarray([[-1e10, -1e10, -1e10], [1e-10, 2e-10, 3e-10]], jnp.float32)
    norms, sums = gm.reference(loss, params, x, 1e-35)
    assert norms[0] == 0 and norms[1] > 1e-35
    for way in ("jit", "eager", "default"):
        with monkeypatch.context() as m:
            if way == "default":
                gm.take_gpu_branches(m)
            g = optclip.clipped_grad(
                loss, l2_clip_norm=1e-35, rescale_to_unit_norm=True, return_grad_norms=True
            )
            grads, aux = run(g, "eager" if way == "eager" else "jit")(params, x)
        np.testing.assert_allclose(aux.grad_norms, norms, rtol=RTOL)
        assert_tree_close(grads, jax.tree.map(lambda s: s / 1e-35, sums))


@pytest.mark.slow
@settings(max_examples=50, deadline=None)
@given(
    shift=st.integers(-100, 100),
    gradient=st.integers(-60, 60),
    clip=st.integers(-60, 60),
    rows=st.sampled_from([1, 3]),
    unit=st.booleans(),
    gpu=st.booleans(),
    mode=st.sampled_from(["jit", "eager"]),
)
@example(shift=100, gradient=-13, clip=-33, rows=1, unit=False, gpu=False, mode="jit")
@example(shift=-100, gradient=0, clip=-60, rows=3, unit=True, gpu=False, mode="eager")
def test_clipped_sums_exact_at_every_balance_of_inputs_gradients_and_clip(
    shift, gradient, clip, rows, unit, gpu, mode
):
    # Layer inputs at 2**shift, output gradients at 2**(gradient - shift), per-example
    # gradients at 2**gradient, clipped to 2**clip (and divided by it with `unit`): wherever
    # they are all normal numbers, and so is the clipped sum, the sum is float64's; the CPU's
    # way and the GPU's, jitted and eager.
    assume(abs(gradient - shift) <= 100 and (not unit or gradient - clip >= -60))
    loss, params, x = _large_inputs(rows, shift)
    scaled = lambda p, x: loss(p, x) * 2.0**gradient * 1e4  # noqa: E731
    c = 2.0**clip
    norms, sums = gm.reference(scaled, params, x, c)
    g = optclip.clipped_grad(
        scaled, l2_clip_norm=c, rescale_to_unit_norm=unit, return_grad_norms=True
    )
    with pytest.MonkeyPatch.context() as m:
        if gpu:
            gm.take_gpu_branches(m)
        grads, aux = run(g, mode)(params, x)
    np.testing.assert_allclose(aux.grad_norms, norms, rtol=RTOL)
    assert_tree_close(grads, jax.tree.map(lambda s: s / c, sums) if unit else sums)


@pytest.mark.every_case
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_record_is_normalized_exactly_at_every_exponent(dtype):
    # `_interpret.scaled` by `_interpret.exponents_of`: the largest magnitude in [0.5, 1),
    # every entry divided by the same power of two, from the dtype's smallest normal numbers
    # to its largest; a zero keeps its values with `ZERO_EXPONENT`; an entry not finite gives
    # zeros and `FLAG`; an exponent per leading index scales each row by its own.
    from optclip.per_example.ghost import _factors, _interpret

    info = jnp.finfo(dtype)
    rng = np.random.default_rng(32)

    @jax.jit
    def f(x):  # (x as one example: its exponent per leading index of size 1, squeezed)
        e = _interpret.exponents_of(x[None], 0)
        return _interpret.scaled(x[None], e)[0], e[0]

    lo, hi = int(info.minexp) + 1, int(info.maxexp)  # (the largest entry's, normal)
    for exponent in sorted({lo, lo // 2, -1, 0, 1, hi // 2, hi}):
        x = np.float64(rng.uniform(0.5, 1.0, size=(3, 4))) * 2.0**exponent
        x[1] = -x[1]
        x = np.asarray(jnp.asarray(x, dtype), np.float64)
        got, e = f(jnp.asarray(x, dtype))
        assert int(e) == exponent and got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float64), x * 2.0**-exponent)
        assert 0.5 <= np.max(np.abs(np.asarray(got, np.float64))) < 1
    zeros, e = f(jnp.zeros((3,), dtype))
    assert int(e) == _factors.ZERO_EXPONENT and not np.any(np.asarray(zeros))
    for bad in (np.nan, np.inf, -np.inf):
        got, e = f(jnp.asarray([1.0, bad, 2.0], dtype))
        assert int(e) == _interpret.FLAG and not np.any(np.asarray(got))
    rows = np.asarray(jnp.asarray([[3.0, -1.0], [0.25, 0.125], [5.0, np.nan]], dtype), np.float64)
    exponents = _interpret.exponents_of(jnp.asarray(rows, dtype), 0)
    got = np.asarray(_interpret.scaled(jnp.asarray(rows, dtype), exponents), np.float64)
    assert list(np.asarray(exponents)) == [2, -1, _interpret.FLAG]
    np.testing.assert_array_equal(got, [[0.75, -0.25], [0.5, 0.25], [0.0, 0.0]])


def test_a_scanned_weights_steps_take_one_exponent_per_example():
    # `_interpret.exponents_of` with `sliced`: a scan level along which the weight is the
    # same at every step (not sliced) is reduced too and kept as size 1, so each example has
    # one exponent for all its steps (the largest), its steps scaled by it exactly; a sliced
    # level keeps one per step; a step not finite flags its example. Steps 2**-110 below the
    # largest are kept exactly (not flushed): the scaled copy is normal down to 2**-126.
    from optclip.per_example.ghost import _interpret

    steps = np.asarray([2.0**-80, 2.0**30, 3.0], np.float64)[:, None, None]  # (T, 1, 1)
    x = steps * np.asarray([[1.0, -0.5], [0.75, 0.25]])[None]  # (T=3, B=2, S=2)
    x[0, 1] = [2.0**-90, 0.0]  # (example 1's first step: a zero, and 2**-120 of its largest)
    e = _interpret.exponents_of(jnp.asarray(x, jnp.float32), 1, (False,))
    assert e.shape == (1, 2) and list(np.asarray(e[0])) == [31, 30]
    got = np.asarray(_interpret.scaled(jnp.asarray(x, jnp.float32), e), np.float64)
    np.testing.assert_array_equal(got, x * 2.0 ** -np.asarray(e, np.float64)[..., None])
    per_step = _interpret.exponents_of(jnp.asarray(x, jnp.float32), 1, (True,))
    assert per_step.shape == (3, 2) and list(np.asarray(per_step[2])) == [2, 2]
    x[2, 0, 1] = np.nan
    e = _interpret.exponents_of(jnp.asarray(x, jnp.float32), 1, (False,))
    assert list(np.asarray(e[0])) == [_interpret.FLAG, 30]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_powers_of_two_are_exact_normal_halves_at_every_exponent(dtype):
    # `_factors.powers_of_two`: each half exact and normal, their product 2**k, for every k
    # from twice the smallest normal exponent to twice the largest (2**k itself subnormal,
    # flushed, or past the largest there), eager and jitted.
    from optclip.per_example.ghost import _factors

    info = jnp.finfo(dtype)
    k = np.arange(2 * int(info.minexp), 2 * (int(info.maxexp) - 1) + 1)
    for f in (_factors.powers_of_two, jax.jit(_factors.powers_of_two, static_argnums=1)):
        first, second = (np.float64(np.asarray(h, np.float32)) for h in f(jnp.asarray(k), dtype))
        assert np.asarray(f(jnp.asarray(k), dtype)[0]).dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.log2(first) + np.log2(second), k)
        np.testing.assert_array_equal(np.log2(first), k // 2)
        assert np.all(first >= float(info.smallest_normal))
        assert np.all(second >= float(info.smallest_normal))
        assert np.all(np.isfinite(first) & np.isfinite(second))


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_step_has_no_conditional_at_any_depth(dtype):
    """No `cond` per site, leaf or layer: the platform's route is chosen once per step (one
    `lax.platform_dependent` at most: a float32 model of dense layers makes no such choice, a
    bfloat16 one does, for its products on a CPU), overflow-safe magnitudes and non-finite
    examples are handled by arithmetic. The count is the same for a model of 1 and of 4
    layers, and the compiled step has no conditional (XLA folds the platform's)."""
    choices = 1 if dtype == jnp.bfloat16 else 0

    def conditionals(layers, platform):
        loss, params, x = gm.unrolled(np.random.default_rng(33), layers=layers, dtype=dtype)
        step = optclip.clipped_grad(loss, l2_clip_norm=1.0, nan_safe=True)
        eqns = list(on_platform(jax.make_jaxpr(step)(params, x).jaxpr, platform))
        loops = sum(eqn.primitive.name in ("cond", "while") for eqn, _ in eqns)
        chosen = sum(eqn.primitive.name == "platform_index" for eqn, _ in eqns)
        return loops, chosen

    for platform in ("cpu", "cuda"):
        assert conditionals(1, platform) == conditionals(4, platform) == (0, choices)
    lowered = {}
    for layers in (1, 4):
        loss, params, x = gm.unrolled(np.random.default_rng(33), layers=layers, dtype=dtype)
        lowered[layers] = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0)).lower(params, x)
    cases = {k: v.as_text().count("stablehlo.case") for k, v in lowered.items()}
    assert cases[1] == cases[4] and (cases[4] > 0) == bool(choices), cases
    assert "stablehlo.if" not in lowered[4].as_text()
    assert "conditional(" not in lowered[4].compile().as_text()


def test_the_normalizations_arithmetic_is_lowered_once_per_shape():
    """The engine's per-tensor arithmetic (a record's or output gradient's exponents, its
    scaled copy, a factor's powers of two) is jitted: a model of 4 layers lowers each such
    function as often as a model of 1 (once per shape) and calls it at every layer, so that
    the step's program grows by calls, not by copies of the arithmetic."""

    def lowered(layers):
        loss, params, x = gm.unrolled(np.random.default_rng(33), layers=layers)
        text = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0)).lower(params, x).as_text()
        names = r"(?:exponents_of|exponent_of|scaled|powers_of_two)\w*"
        defined = re.findall(rf"func\.func private @{names}\(", text)
        called = re.findall(rf"call @{names}\(", text)
        return len(defined), len(called)

    (defined_1, called_1), (defined_4, called_4) = lowered(1), lowered(4)
    assert defined_4 == defined_1 > 0, (defined_1, defined_4)
    assert called_4 >= called_1 + 3 * 4, (called_1, called_4)


@pytest.mark.parametrize("way", ["cpu", "default"])
def test_a_model_of_single_rows_is_exact_on_every_platform(way, monkeypatch):
    """The MLP (each dense layer applied to one row per example, its biases materialised),
    the CPU's way and the GPU's (`lax.platform_dependent` taking its default here), against
    float64, at magnitudes whose squares overflow, with a dropped non-finite example."""
    if way == "default":
        gm.take_gpu_branches(monkeypatch)
    loss, params, x = gm.mlp(np.random.default_rng(33))
    x = x.at[2, 1].set(np.nan)
    huge = lambda p, x: loss(p, x) * 1e22  # noqa: E731
    for f in (loss, huge):
        step = optclip.clipped_grad(f, l2_clip_norm=1.0, return_grad_norms=True)
        grads, aux = jax.jit(step)(params, x)
        norms = np.asarray(aux.grad_norms)
        assert np.isnan(norms[2]) and np.isfinite(np.delete(norms, 2)).all()
        kept = np.delete(np.arange(x.shape[0]), 2)
        want, sums = gm.reference(f, params, x[kept], 1.0)
        np.testing.assert_allclose(np.delete(norms, 2), want, rtol=RTOL)
        assert_tree_close(grads, sums)


def test_an_input_of_the_loss_read_by_one_product_takes_the_factor(mode, monkeypatch):
    """A record that is an input of the loss (or its values reshaped), read by one product
    outside scans (`_trace.input_records`), takes each example's factor in that product's clipped
    sum (`_sums._weights_record`), the larger side though it is; an activation, an input that
    two products read and an input inside a scan keep the smaller side's rule. Each model
    against float64, its inputs from 1e-30 to 1e30 by example, beside a padding example and a
    dropped non-finite one."""
    from optclip.per_example.ghost import _sums

    seen = []
    weights = _sums._weights_record

    def spy(site, record, cotangent, input_):
        chosen = weights(site, record, cotangent, input_)
        seen.append((record[0].shape[-1], cotangent[0].shape[-1], input_, chosen))
        return chosen

    monkeypatch.setattr(_sums, "_weights_record", spy)
    rng = np.random.default_rng(35)
    a, b, c = (jnp.asarray(rng.normal(size=n), jnp.float32) for n in ((5, 4), (5, 2), (4, 3)))
    x = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)

    def layers(p, x):  # (x: 5 wide, its product 4; the activation 4, its product 3)
        return jnp.sum(jnp.abs(x @ p["a"]) @ p["c"])

    def two_readers(p, x):
        return jnp.sum(jnp.abs(x @ p["a"])) + jnp.sum(jnp.abs(x @ p["b"]) * 0.5)

    mlp = (layers, {"a": a, "c": c}, x)
    shared = (two_readers, {"a": a, "b": b}, x)
    scanned = gm.recurrent(rng, batch=6)
    expected = {
        "mlp": [(5, 4, True, True), (4, 3, False, False)],
        "shared": [(5, 4, False, False), (5, 2, False, False)],
        # (a step's input, its state, the inner scan's, the last state outside the scans)
        "scanned": [(3, 3, False, False)] * 4,
    }
    for name, (loss, params, x) in {"mlp": mlp, "shared": shared, "scanned": scanned}.items():
        seen.clear()
        scale = np.asarray([1e-30, 1.0, 1e30, 3e-7, 1.0, 1.0][: x.shape[0]], np.float32)
        x = x * scale.reshape(-1, *[1] * (x.ndim - 1))
        bad = x.at[4].set(np.nan)
        padding = np.arange(x.shape[0]) == 3
        step = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
        grads, aux = run(step, mode)(params, bad, is_padding_example=padding)
        assert sorted(seen) == sorted(expected[name]), (name, seen)
        kept = [i for i in range(x.shape[0]) if i not in (3, 4)]
        norms, sums = gm.reference(loss, params, x[np.asarray(kept)], 1.0)
        assert not np.isfinite(aux.grad_norms[4])
        np.testing.assert_allclose(np.asarray(aux.grad_norms)[kept], norms, rtol=RTOL)
        assert_tree_close(grads, sums)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_convolution_without_a_closed_form_says_why_and_is_exact(mode):
    """A convolution whose parameter is not a plain view of its kernel is materialised, each
    case with its own reason in `ghost_report` (one reason once said "a reshape, or
    `batch_group_count`" for all three), and its numbers match float64."""
    rng = np.random.default_rng(31)
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(h, k):
        return lax.conv_general_dilated(h, k, (1, 1), "SAME", dimension_numbers=dn)

    x = jnp.asarray(rng.normal(size=(3, 1, 4, 4, 2)), jnp.float32)
    params = {
        "image": jnp.asarray(rng.normal(size=(1, 4, 4, 2)) * 0.5, jnp.float32),
        "flat": jnp.asarray(rng.normal(size=(36,)) * 0.3, jnp.float32),
        "batched": jnp.asarray(rng.normal(size=(3, 3, 2, 2)) * 0.3, jnp.float32),
    }

    def loss(p, x):
        k = jnp.tanh(x[0, 0, :3, :3, :1, None])  # (a kernel made from the data)
        a = conv(p["image"], jnp.broadcast_to(k, (3, 3, 2, 2)))  # the parameter as input
        b = conv(x[0], p["flat"].reshape(3, 3, 2, 2))  # a reshaped kernel
        c = lax.conv_general_dilated(  # a kernel's gradient form: the batch split in groups
            jnp.concatenate([x[0], x[0] * 0.5]),
            p["batched"],
            (1, 1),
            "SAME",
            dimension_numbers=dn,
            batch_group_count=2,
        )
        return jnp.sum(jnp.sin(a)) + jnp.sum(jnp.sin(b)) + jnp.sum(jnp.cos(c))

    report = optclip.ghost_report(loss, params, x)
    reasons = {k: r.reason for k, r in report.items()}
    assert {r.mode for r in report.values()} == {"materialised"}, report
    assert "of a parameter as its input (not its kernel)" in reasons["['image']"]
    assert "by a reshaped or broadcast kernel" in reasons["['flat']"]
    assert "with `batch_group_count` (no closed form written)" in reasons["['batched']"]
    check_against_reference(loss, params, x, 0.5, mode=mode)


def separable(rng, examples, size=8, features=64):
    """Two depthwise-separable blocks (a depthwise 3x3 and a pointwise 1x1 kernel of
    `features` features, residual) on `examples` images of ``size x size``."""
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(h, k, groups=1):
        return lax.conv_general_dilated(
            h, k, (1, 1), "SAME", dimension_numbers=dn, feature_group_count=groups
        )

    params = {}
    for i in range(2):
        depthwise = rng.normal(size=(3, 3, 1, features)) / 3
        params[f"depthwise{i}"] = jnp.asarray(depthwise, jnp.float32)
        pointwise = rng.normal(size=(1, 1, features, features)) / np.sqrt(features)
        params[f"pointwise{i}"] = jnp.asarray(pointwise, jnp.float32)

    def loss(p, x):
        h = x
        for i in range(2):
            mixed = jax.nn.relu(conv(h, p[f"depthwise{i}"], groups=features))
            h = h + conv(mixed, p[f"pointwise{i}"])
        return jnp.sum(jnp.sin(h))

    x = jnp.asarray(rng.normal(size=(examples, size, size, features)), jnp.float32)
    return loss, params, x


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("examples", [1, 2])
@pytest.mark.parametrize("formed", [True, False], ids=["products", "patches"])
def test_convolutions_norms_one_example_at_a_time_match_float64(
    formed, examples, mode, monkeypatch
):
    """Depthwise-separable blocks (a depthwise 3x3 and a pointwise 1x1 kernel of 64 features,
    each of whose norms is its per-example product's squares): against float64, jitted and
    eager, and the same in a second call. Their route is ``PRODUCT``: each per-example
    gradient formed once, over the batch (`_norms.products`), gives the norm and the clipped
    sum. With those products not formed (`patches`), each kernel's norm is its patches'
    direct product (`_factors.self_term`), taken one example at a time as a CPU takes them
    for images of real sizes (`_norms.LOOP_WORK`, forced here), and the four convolutions'
    clipped sums go one after another (`_sums.in_turn`). With an `optimization_barrier` before
    the squares, XLA 0.10.2 on a CPU gave norms 0.23 off there for a batch of one and 0.40 for
    two (jitted; eager, too), 1.1e-3 off for one example through the 1x1 kernel alone, and
    other values in another process."""
    from optclip.per_example.ghost import _norms, _sums

    monkeypatch.setattr(_norms, "LOOP_WORK", 0)
    formed_products = []
    products = _norms.products
    spy = lambda plans, t: formed_products.append(len(products(plans, t))) or {}  # noqa: E731
    if not formed:
        monkeypatch.setattr(_norms, "products", spy)
    sums = []  # (the clipped sums' loops)
    in_turn = _sums.in_turn
    spy_sums = lambda sites, *rest: sums.append(len(sites)) or in_turn(sites, *rest)  # noqa: E731
    monkeypatch.setattr(_sums, "in_turn", spy_sums)
    loss, params, x = separable(np.random.default_rng(37), examples)
    report = optclip.ghost_report(loss, params, x)
    assert {r.mode for r in report.values()} == {"ghost"}, report
    grads64 = gm.per_example_grads(loss, params, x)
    first, again = (
        run(optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True), mode)(params, x)
        for _ in range(2)  # (each traced anew)
    )
    check_against_grads(first, grads64, 1.0)
    check_against_grads(again, grads64, 1.0)
    np.testing.assert_array_equal(first[1].grad_norms, again[1].grad_norms)
    if formed:
        assert not sums, sums  # (no convolution's sum from its output gradient)
    else:
        assert set(formed_products) == {4} and sums and set(sums) == {4}, (formed_products, sums)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_convolutions_product_is_formed_where_it_is_no_larger_than_its_output_gradient(
    mode, monkeypatch
):
    """The ``PRODUCT`` route (`_plans.route`): a convolution outside scans whose per-example
    kernel gradient takes fewer multiply-adds than its Grams and is no larger than its output
    gradient has it formed in the tapped pass (`_norms.products`); not one whose input
    features times window exceed its positions, one in a scan, one scaled, nor a kernel used
    twice. Every model's norms and sums against float64, with an example at 1e-20 and one at
    1e20 (their squares out of float32's range), jitted and eager."""
    from optclip.per_example.ghost import _norms

    formed: list = []
    products = _norms.products
    spy = lambda plans, t: formed.append(sorted(products(plans, t))) or products(plans, t)  # noqa: E731
    monkeypatch.setattr(_norms, "products", spy)

    def conv(h, k, groups=1):
        dn = ("NWC", "WIO", "NWC")
        return lax.conv_general_dilated(
            h, k, (1,), "SAME", dimension_numbers=dn, feature_group_count=groups
        )

    rng = np.random.default_rng(41)
    k = jnp.asarray(rng.normal(size=(3, 2, 4)) / 3, jnp.float32)

    def head(y):  # (linear: the examples at 1e20 have gradients of 1e20, no rounding of a sine)
        return jnp.sum(y * jnp.linspace(-1.0, 1.0, y.shape[-1]))

    def scanned(p, x):
        return head(lax.scan(lambda h, _: (conv(h, p[0])[..., :2], None), x, None, length=2)[0])

    models = {  # name: (loss, params, images' width, the leaves formed)
        "alone": (lambda p, x: head(conv(x, p[0])), [k], 12, [0]),
        "wide input": (lambda p, x: head(conv(x, p[0])), [k], 5, []),
        "scaled": (lambda p, x: head(conv(x, 2 * p[0])), [k], 12, []),
        "twice": (lambda p, x: head(conv(conv(x, p[0])[..., :2], p[0])), [k], 12, []),
        "in a scan": (scanned, [k], 12, []),
    }
    for name, (loss, params, width, want) in models.items():
        x = rng.normal(size=(3, width, 2)).astype(np.float32)
        x[1] *= np.float32(1e-20)
        x[2] *= np.float32(1e20)
        formed.clear()
        step = run(optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True), mode)
        result = step(params, jnp.asarray(x))
        assert formed == [want], (name, formed)
        check_against_grads(result, gm.per_example_grads(loss, params, jnp.asarray(x)), 1.0)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("formed", [True, False], ids=["products", "patches"])
def test_convolutions_norms_in_turn_pad_drop_and_scale_as_the_batch_does(formed, mode, monkeypatch):
    """Depthwise-separable blocks by their route, ``PRODUCT`` (each kernel's per-example
    gradient formed over the batch), and with those products not formed (`patches`: the
    norms one example at a time, forced by `_norms.LOOP_WORK`, and the sums in turn), on what
    the batched norms handle: a padding example contributes nothing, a zero example has norm
    0 and no NaN, a NaN example is dropped with its norm NaN, and gradients whose squares
    overflow float32: against float64, jitted and eager."""
    from optclip.per_example.ghost import _norms

    monkeypatch.setattr(_norms, "LOOP_WORK", 0)
    if not formed:
        monkeypatch.setattr(_norms, "products", lambda plans, t: {})
    loss, params, x = separable(np.random.default_rng(39), 4, size=4, features=8)
    x = x.at[2].set(0.0)
    grads64 = gm.per_example_grads(loss, params, x)
    step = magnitude_step(loss, 1.0, mode)  # (one program for the three batches)
    padding = np.array([False, True, False, False])
    result = step(params, x, np.float32(1), is_padding_example=padding)
    check_against_grads(result, grads64, 1.0, padding=padding)
    assert result[1].grad_norms[2] == 0.0, result[1].grad_norms
    none = np.zeros(4, bool)
    huge = step(params, x, np.float32(1e22), is_padding_example=none)
    check_against_grads(huge, grads64, 1.0, magnitude=1e22)
    grads, aux = step(params, x.at[3, 0, 0, 0].set(np.nan), np.float32(1), is_padding_example=none)
    norms = np.asarray(aux.grad_norms)
    assert np.isnan(norms[3]) and np.isfinite(norms[:3]).all(), norms
    kept_norms, kept_sums = gm.reference_from(grads64, 1.0, keep=[0, 1, 2])
    np.testing.assert_allclose(norms[:3], kept_norms, rtol=RTOL)
    assert_tree_close(grads, kept_sums)


@pytest.mark.parametrize("name", ["conv", "conv_shared"])
@pytest.mark.parametrize("way", ["cpu", "gpu"])
def test_a_kernels_sum_is_its_convolutions_vjp_on_every_platform(way, name, monkeypatch):
    """The kernels' clipped sums: on a CPU written out as one convolution laid out as XLA's
    CPU runtime convolves fastest (`_products.conv_view_sum`: JAX's VJP of the batched
    convolution, in the sums' `cond` branch, ran 25x slower there), elsewhere JAX's VJP (the
    GPU's branch taken here). Against float64 for kernels depthwise, grouped, used twice,
    dilated, stacked under a scan, strided with padding, 1-D in another layout; at
    magnitudes whose squares overflow (each side weighted by its share of the factor); with a
    dropped non-finite example (the sums' other path, one example after another)."""
    if way == "gpu":
        gm.take_gpu_branches(monkeypatch)
    loss, params, x, grads64 = cached_model(name, 21)
    step = magnitude_step(loss, 0.5)  # (one program for the three batches)
    for magnitude in (1.0, 1e22):
        check_against_grads(
            step(params, x, np.float32(magnitude)), grads64, 0.5, magnitude=magnitude
        )
    grads, aux = step(params, x.at[1].set(np.nan), np.float32(1))
    assert np.isnan(aux.grad_norms[1]) and np.isfinite(np.delete(aux.grad_norms, 1)).all()
    _, sums = gm.reference_from(grads64, 0.5, keep=[0, 2])
    assert_tree_close(grads, sums)


@pytest.mark.parametrize("name", ["tied", "transformer", "conv", "recurrent", "conv_shared"])
def test_every_forced_route_gives_the_same_numbers(name):
    """`optclip.force_ghost_route`, the setting for bisecting a wrong number: every route
    (each leaf materialised, every ghost leaf by its Grams, or by its direct product) gives
    the chosen route's norms and sums to float32 rounding, at ordinary magnitudes and at
    magnitudes whose squares overflow; a step traced inside the context keeps its route."""
    loss, params, x, grads64 = cached_model(name, 12)
    huge = lambda p, x: loss(p, x) * 1e22  # noqa: E731
    unforced = {k: r.mode for k, r in optclip.ghost_report(loss, params, x).items()}
    assert "ghost" in unforced.values(), unforced
    magnitudes = [np.float32(1), np.float32(1e22)]  # (one program for both)
    step = magnitude_step(loss, 1.0)
    chosen = [step(params, x, m) for m in magnitudes]
    for route in ("materialised", "grams", "direct"):
        with optclip.force_ghost_route(route):
            step = magnitude_step(loss, 1.0)
            reports = [
                {k: r.mode for k, r in optclip.ghost_report(f, params, x).items()}
                for f in (loss, huge)
            ]
            forced = [step(params, x, m) for m in magnitudes]
        if route == "materialised":  # (every used leaf; the unused stay unused)
            want = {k: "unused" if m == "unused" else "materialised" for k, m in unforced.items()}
        else:  # (a route changes how a ghost leaf's norm is computed, not which go ghost)
            want = unforced
        assert reports == [want, want], (route, reports)
        for m, result, unforced_result in zip(magnitudes, forced, chosen, strict=True):
            again = step(params, x, m)  # (outside the context: the same program)
            np.testing.assert_array_equal(again[1].grad_norms, result[1].grad_norms)
            check_against_grads(result, grads64, 1.0, magnitude=float(m))
            np.testing.assert_allclose(
                result[1].grad_norms, unforced_result[1].grad_norms, rtol=2e-6
            )
    with pytest.raises(ValueError, match="route"):
        with optclip.force_ghost_route("careful"):
            pass


@pytest.mark.parametrize(
    "name", ["tied", "transformer", "conv", "recurrent", "scanned", "mlp", "conv_shared"]
)
def test_per_example_grams_agree_with_the_batched_ones(name, monkeypatch):
    # On a CPU, where one example's Grams are large (`_norms.LOOP_WORK` multiply-adds), the
    # norms are computed one example after another: forced here (the tests' models are small)
    # and checked against the float64 reference and the batch's values, with a non-finite
    # example dropped, at a magnitude whose squares overflow, and eager.
    from optclip.per_example.ghost import _norms

    loss, params, x, grads64 = cached_model(name, 13)
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    loops = str(jax.make_jaxpr(g)(params, x)).count("scan[")
    batched = jax.jit(g)(params, x)
    monkeypatch.setattr(_norms, "LOOP_WORK", 0)
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)  # (traced anew)
    text = str(jax.make_jaxpr(g)(params, x))  # one more loop on a CPU (`lax.map`)
    assert text.count("scan[") > loops
    step = magnitude_step(loss, 1.0)  # (one program for every batch and magnitude)
    looped = step(params, x, np.float32(1))
    check_against_grads(looped, grads64, 1.0)
    np.testing.assert_allclose(looped[1].grad_norms, batched[1].grad_norms, rtol=1e-6)
    assert_tree_close(looped[0], jax.tree.map(np.asarray, batched[0]), rtol=1e-6)
    huge_step = magnitude_step(loss, 1.0, "eager") if name == "mlp" else step
    check_against_grads(huge_step(params, x, np.float32(1e22)), grads64, 1.0, magnitude=1e22)
    if name == "mlp":
        grads, aux = step(params, x.at[1, 0].set(np.nan), np.float32(1))
        assert np.isnan(aux.grad_norms[1]) and np.isfinite(np.delete(aux.grad_norms, 1)).all()
        _, sums = gm.reference_from(grads64, 1.0, keep=np.delete(np.arange(x.shape[0]), 1))
        assert_tree_close(grads, sums)


def _bilinear_steps(sizes):
    """The jitted step of ``sum((x @ w) * y)`` (each example's gradient ``x^T y``, `sizes` =
    ``(K, Sx, Sy)``) by each route: ``{route: step}``, compiled once per size."""
    k, sx, sy = sizes

    def loss(w, batch):
        x, y = batch
        return jnp.sum((x @ w) * y)

    steps = {}
    for route in (None, "grams", "direct"):
        with optclip.force_ghost_route(route):
            g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
            w = jnp.zeros((sx, sy))
            batch = (jnp.zeros((3, k, sx)), jnp.zeros((3, k, sy)))
            steps[route] = jax.jit(g).lower(w, batch).compile()
    return steps


BILINEAR = {
    sizes: functools.cache(lambda sizes=sizes: _bilinear_steps(sizes))
    for sizes in [(5, 1, 1), (4, 3, 2)]
}


@settings(max_examples=60, deadline=None)
@given(
    shifts=st.tuples(st.integers(-75, 75), st.integers(-75, 75)),
    sizes=st.sampled_from(list(BILINEAR)),
    seed=st.integers(0, 2**31),
)
@example(shifts=(0, 0), sizes=(5, 1, 1), seed=1291421)  # (terms that cancel: 2.1e-6 relative)
@example(shifts=(75, 75), sizes=(4, 3, 2), seed=0)
@example(shifts=(-75, -75), sizes=(4, 3, 2), seed=0)
def test_norms_and_sums_exact_at_every_balance_of_magnitudes(shifts, sizes, seed):
    # One use's factors x (K, Sx) and y (K, Sy) at magnitudes 2**shift: by every route, the
    # norm equals the float64 norm of sum_k x_k (outer) y_k to float32 rounding, and the
    # clipped sum the float64 one (one compiled step per size and route: only the values
    # are drawn). Where the sum's terms cancel, float32's rounding is relative to the terms,
    # not to the sum: its square is then within 1e-6 of the squared norm of the terms'
    # magnitudes. A norm past float32's range is inf, one below its normal numbers 0.
    k, sx, sy = sizes
    rng = np.random.default_rng(seed)
    x = np.float32(rng.normal(size=(3, k, sx)) * 2.0 ** shifts[0])
    y = np.float32(rng.normal(size=(3, k, sy)) * 2.0 ** shifts[1])
    g64 = np.einsum("bkc,bkf->bcf", np.float64(x), np.float64(y))
    expected = np.sqrt(np.sum(g64**2, axis=(1, 2)))
    magnitudes = np.sum(
        np.einsum("bkc,bkf->bcf", np.abs(np.float64(x)), np.abs(np.float64(y))) ** 2, axis=(1, 2)
    )
    info = np.finfo(np.float32)
    want = np.where(expected > info.max, np.inf, expected)
    want = np.where(expected < info.tiny, 0.0, want)
    for route, step in BILINEAR[sizes]().items():
        sums, aux = step(jnp.zeros((sx, sy)), (x, y))
        got = np.float64(np.asarray(aux.grad_norms))
        close = np.isclose(got, want, rtol=2e-6, atol=info.tiny)
        with np.errstate(invalid="ignore", over="ignore"):  # (inf - inf where both are inf)
            cancelled = np.abs(got**2 - want**2) <= 1e-6 * magnitudes
        assert np.all(close | cancelled), (route, got, want, np.sqrt(magnitudes))
        inside = (expected < info.max / 4) & (expected > 2.0**-100)
        if np.all(inside):  # (each example's error: float32's, relative to its terms'
            # magnitude, the more so where they cancel: as `method="vmap"`'s)
            factors = np.minimum(1.0, 1.0 / expected)
            ref = np.einsum("b,bcf->cf", factors, g64)
            terms = np.sqrt(magnitudes)
            error = np.sum(4e-6 * factors * terms * np.maximum(1.0, terms / expected))
            np.testing.assert_allclose(np.asarray(sums, np.float64), ref, rtol=0, atol=error)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_parameters_broadcast_by_every_elementwise_operation(mode):
    # A parameter broadcast against a sequence by `sub`, `div`, `mul` and `add` (size-1 axes:
    # `_interpret._apart` sums its per-example gradient with them dropped; a sum or a
    # difference keeps no residual, a product or a quotient keeps its operands).
    rng = np.random.default_rng(21)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
        "s": jnp.asarray(rng.uniform(1, 2, size=3), jnp.float32),
        "b": jnp.asarray(rng.normal(size=3), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(5, 6, 4)), jnp.float32)

    def loss(p, x):
        h = (p["b"] - x @ p["w"]) / p["s"]
        return jnp.sum(jnp.tanh(jnp.sin(h) * p["s"] - 2.0 * p["b"]) ** 2)

    check_against_reference(loss, params, x, 0.5, mode=mode)


def test_zero_gradient_gives_no_nan():
    loss, params, x = gm.mlp(np.random.default_rng(3))
    linear = lambda p, x: jnp.sum(x @ p["w1"])  # noqa: E731
    x = x.at[1].set(0.0)
    grads, aux = check_against_reference(linear, params, x, 1.0)
    assert aux.grad_norms[1] == 0
    zero = jnp.zeros_like(x)
    grads, aux = optclip.clipped_grad(linear, l2_clip_norm=1.0, return_grad_norms=True)(
        params, zero
    )
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))
    assert np.all(np.asarray(aux.grad_norms) == 0)
    # Beside an example whose squares overflow (the batch's norms then computed one example at
    # a time, scaled), a zero gradient still gives 0.
    huge = x.at[0].multiply(1e25)
    grads, aux = check_against_reference(linear, params, huge, 1.0)
    assert aux.grad_norms[1] == 0


@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_padding_examples_contribute_exactly_zero(method):
    loss, params, x = gm.embedding(np.random.default_rng(4))
    padding = jnp.array([False, True, False, False, True, False])
    g = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=0.5, method=method))
    grads = g(params, x, is_padding_example=padding)
    other = x.at[1].set(0).at[4].set(3)  # other data in the padding slots: the same bits
    again = g(params, other, is_padding_example=padding)
    _, sums = gm.reference(loss, params, x, 0.5, np.asarray(padding))
    assert_tree_close(grads, sums)
    assert_tree_close(again, sums)
    if jax.default_backend() == "cpu":
        # (A GPU's scatter-add, the embedding's sum, adds its rows in no fixed order, so its
        # bits may differ from one call to the next whatever the padding holds.)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.every_case
@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_normalize_by_divides_the_clipped_sum(method):
    # jax_privacy's `normalize_by`: the clipped sum divided by it (the norms are not).
    loss, params, x = gm.mlp(np.random.default_rng(5))
    _, sums = gm.reference(loss, params, x, 0.5)
    g = optclip.clipped_grad(loss, l2_clip_norm=0.5, method=method, normalize_by=4.0)
    assert_tree_close(jax.jit(g)(params, x), jax.tree.map(lambda s: s / 4.0, sums))


@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_a_nonfinite_example_is_dropped_or_propagated(method):
    loss, params, x = gm.mlp(np.random.default_rng(5))
    bad = x.at[2, 0].set(jnp.inf)
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, method=method, return_grad_norms=True)
    grads, aux = jax.jit(g)(params, bad)
    assert not np.isfinite(aux.grad_norms[2])
    keep = np.arange(x.shape[0]) != 2
    _, sums = gm.reference(loss, params, x, 1.0, ~keep)
    assert_tree_close(grads, sums)
    unsafe = optclip.clipped_grad(loss, l2_clip_norm=1.0, method=method, nan_safe=False)
    assert all(np.all(np.isnan(g)) for g in jax.tree.leaves(jax.jit(unsafe)(params, bad)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_models_accumulate_norms_in_float32(dtype):
    model, params, x = gm.sequence(np.random.default_rng(6), dtype=dtype)
    # Norms in the thousands: float16 squares of such gradients overflow. The loss is scaled,
    # not the weights: a `sin` of arguments in the thousands is so coarse in float16 that two
    # programs' roundings (the batch's, one example's) give norms a few percent apart.
    loss = lambda p, x: 1000 * model(p, x)  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    grads, aux = jax.jit(g)(params, x)
    assert aux.grad_norms.dtype == jnp.float32
    assert all(leaf.dtype == dtype for leaf in jax.tree.leaves(grads))
    reference = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True, method="vmap")
    ref_grads, ref_aux = jax.jit(reference)(params, x)
    assert np.all(np.isfinite(ref_aux.grad_norms)) and np.min(ref_aux.grad_norms) > 300
    # The ghost norm is that of the gradient before its rounding to the parameters' dtype.
    np.testing.assert_allclose(aux.grad_norms, ref_aux.grad_norms, rtol=1e-2)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=3e-2 * np.max(np.abs(b)))


@pytest.mark.every_case  # (the eager engine: test_ghost_eager.py in the fast tier)
@pytest.mark.parametrize("way", ["jit", pytest.param("eager", marks=pytest.mark.slow), "gpu"])
def test_float16_sums_below_float16s_normal_numbers_are_rounded_once(way, monkeypatch):
    # The recurrent model in float16 clipped to 1e-4: its leaves' clipped sums are float16
    # subnormal numbers (v's largest entry 1.4e-5, below 6.1e-5). Each example's products
    # and each layer of the scans are added in float32, the sum rounded to float16 once, as
    # `method="vmap"` does: v came out 7.8e-3 of its largest entry off float64 when each
    # example's product was rounded to float16 first (3.3x vmap's 2.4e-3).
    loss, params, x = gm.recurrent(np.random.default_rng(0), dtype=jnp.float16)
    _, sums = gm.reference(loss, params, x, 1e-4)
    assert np.max(np.abs(sums["v"])) < float(jnp.finfo(jnp.float16).smallest_normal)
    if way == "gpu":
        gm.take_gpu_branches(monkeypatch)

    methods = lambda p, x: {  # noqa: E731 (jitted: one program for both)
        m: optclip.clipped_grad(loss, l2_clip_norm=1e-4, method=m)(p, x) for m in ("auto", "vmap")
    }
    results = run(methods, "eager" if way == "eager" else "jit")(params, x)

    def errors(method):
        grads = results[method]
        assert all(leaf.dtype == jnp.float16 for leaf in jax.tree.leaves(grads))
        return {
            k: np.max(np.abs(np.asarray(grads[k], np.float64) - sums[k])) / np.max(np.abs(sums[k]))
            for k in sums
        }

    ghost, vmap = errors("auto"), errors("vmap")
    for k in sums:
        assert ghost[k] <= 1.5 * vmap[k] + 2**-11, (k, ghost, vmap)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_float16_sides_weighted_below_their_precision_keep_it(mode):
    # Float16's normal numbers stop at 6e-5. Inputs at 256x and output gradients at 4e-3,
    # clipped from norms of 2-3 to 1e-3: each example's weighted output gradient (4e-6)
    # would round to float16's subnormal numbers, 1.5% apart. Each site's sum is taken with
    # the weights divided by the largest example's power of two (`_sums.common_exponent`):
    # within float16's rounding of float64 (method="vmap": 1.1e-3). Clipped to 1, the plain
    # sums.
    loss, params, x = _large_inputs(1, shift=8, dtype=jnp.float16, gain=1.0)
    for clip in (1e-3, 1.0):
        g = optclip.clipped_grad(loss, l2_clip_norm=clip)
        _, sums = gm.reference(loss, params, x, clip)
        assert_tree_close(run(g, mode)(params, x), sums, rtol=2e-3)


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_a_bfloat16_batch_stays_bfloat16_in_the_loop_over_its_examples(monkeypatch):
    """`Tapped.example` on bfloat16 records: XLA on a CPU slices a bfloat16 array in float32,
    and hoisted a float32 copy of each whole record and output gradient out of each loop over
    the examples (on a CPU the norms of large Grams, `_norms.norms`), held as the loop's
    state beside everything they read. The loop's state holds the batch in bfloat16 only."""
    from optclip.per_example.ghost import _norms

    if jax.default_backend() != "cpu":
        pytest.skip("XLA's float32 slicing of bfloat16 is the CPU's")
    monkeypatch.setattr(_norms, "LOOP_WORK", 0)  # (the norms one example at a time)
    loss, params, x = gm.sequence(np.random.default_rng(0), dtype=jnp.bfloat16)
    step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))
    text = step.lower(params, x).compile().as_text()
    loops = [line.split(" while(")[0] for line in text.splitlines() if " while(" in line]
    assert len(loops) == 1, loops
    for state in loops:
        assert "bf16[5,1,3,4]" in state  # (the records, sliced in the loop)
        assert not re.search(r"f32\[5,", state), state


@pytest.mark.parametrize(
    "model, dtype", [("mlp", jnp.float16), ("mlp", jnp.bfloat16), ("sequence", jnp.bfloat16)]
)
def test_low_precision_sums_with_a_dropped_example_add_up_in_float32(model, dtype, mode):
    # With a dropped example whose gradient is not finite (its records and output gradients
    # zeroed), the terms are added in float32 and rounded once to the leaf's dtype, as the
    # materialising reference's are. Against the float64 reference too (the examples kept,
    # their sum rounded to the leaf's dtype).
    if model == "mlp":
        loss, params, x = gm.mlp(np.random.default_rng(35), dtype=dtype, batch=256)
    else:
        loss, params, x = gm.sequence(np.random.default_rng(35), dtype=dtype, batch=64)
    bad = x.at[3, 0].set(np.inf)
    kept = np.delete(np.arange(x.shape[0]), 3)
    _, reference = gm.reference(loss, params, x[kept], 1e3)
    sums = {}
    for method in ("auto", "vmap"):
        g = optclip.clipped_grad(loss, l2_clip_norm=1e3, method=method)
        sums[method] = run(g, mode)(params, bad)
    leaves = zip(*(jax.tree.leaves(t) for t in (sums["auto"], sums["vmap"], reference)))
    for a, b, want in leaves:
        a, b, want = (np.asarray(v, np.float32) for v in (a, b, want))
        for got in (a, b):
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-2 * np.max(np.abs(want)))


def shapes_in(jaxpr):
    """Every shape of every value a jaxpr (and the jaxprs inside it) computes."""
    return {
        tuple(v.aval.shape)
        for eqn in equations(jaxpr)
        for v in eqn.outvars
        if hasattr(v.aval, "shape")
    }


def grams_in(jaxpr):
    """``(precision, operand shapes)`` of every per-example Gram (or direct product) of the
    norms in a jaxpr and the jaxprs inside it: the `dot_general`s that `_factors.gram` and
    `_factors.self_term` write (two ``(L, B, H, K, S)`` factors batched over ``(L, B, H)``, a
    Gram's layers and heads of size 1 left out), by the frames of their equations."""
    out = []
    for eqn in equations(jaxpr):
        frames = eqn.source_info.traceback.frames
        written = {f.function_name for f in frames if f.file_name.endswith("ghost/_factors.py")}
        if eqn.primitive.name == "dot_general" and written & {"gram", "self_term"}:
            shapes = tuple(v.aval.shape for v in eqn.invars)
            out.append((eqn.params["precision"], shapes))
    return out


P = lax.Precision
# `jax_default_matmul_precision`: the precision of the Grams of the products it sets (a GPU
# computes DEFAULT and HIGH as TF32, HIGHEST as float32; a TPU 1, 3 and 6 passes of bfloat16).
GRAM_PRECISION = {
    None: None,
    "bfloat16": (P.DEFAULT, P.DEFAULT),
    "tensorfloat32": (P.HIGH, P.HIGH),
    "float32": (P.HIGHEST, P.HIGHEST),
    "TF32_TF32_F32": (P.HIGH, P.HIGH),
    "BF16_BF16_F32_X3": (P.HIGH, P.HIGH),
    "BF16_BF16_F32_X6": (P.HIGHEST, P.HIGHEST),
    "F16_F16_F32": (P.HIGHEST, P.HIGHEST),  # (any other algorithm: exact)
}


@pytest.mark.every_case
@pytest.mark.parametrize("default", list(GRAM_PRECISION))
@pytest.mark.parametrize("name", ["mlp", "sequence", "scanned", "conv"])
def test_grams_are_computed_at_the_precision_of_their_product(name, default):
    # At JAX's default precision a GPU's float32 products are TF32: the norms' Grams at
    # HIGHEST (float32) would be several times slower than the products they stand for.
    # A model of single rows (the MLP) has no Gram: its inner products are elementwise
    # float32 reductions, at every default.
    loss, params, x = MODELS[name](np.random.default_rng(0))
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    with jax.default_matmul_precision(default):
        grams = grams_in(jax.make_jaxpr(g)(params, x).jaxpr)
    if name == "mlp":
        assert grams == []
    else:
        assert grams and {p for p, _ in grams} == {GRAM_PRECISION[default]}


@pytest.mark.every_case
@pytest.mark.parametrize(
    "written, expected",
    [
        ((P.DEFAULT, P.HIGHEST), (P.HIGHEST, P.HIGHEST)),  # one per operand: the higher
        (P.HIGH, (P.HIGH, P.HIGH)),
        (lax.DotAlgorithmPreset.DEFAULT, None),  # JAX's default
        (lax.DotAlgorithm(jnp.float32, jnp.float32, jnp.float32), (P.HIGHEST, P.HIGHEST)),
    ],
)
def test_grams_follow_a_precision_written_in_the_model(written, expected):
    loss = lambda w, x: jnp.sum(jnp.sin(jnp.dot(x, w, precision=written)))  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    grams = grams_in(jax.make_jaxpr(g)(jnp.ones((3, 4)), jnp.ones((2, 5, 3))).jaxpr)
    assert grams and {p for p, _ in grams} == {expected}


def test_a_grams_layers_and_heads_of_size_1_are_left_out_of_its_product():
    """`_factors.gram`: a Gram of a layer outside scans with one head is a product batched over
    the examples alone (``(B, K, S)`` operands); one of stacked layers keeps its layers
    (``(L, B, K, S)``). XLA on a CPU copied the output of a product batched over ``(1, B,
    1)``. The norms and sums against the float64 reference."""
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.normal(size=(13, 11)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(3, 5, 13)), jnp.float32)
    loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)  # noqa: E731 (5 rows: the Gram route)
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    grams = grams_in(jax.make_jaxpr(g)(w, x).jaxpr)
    assert grams and {shapes for _, shapes in grams} == {
        ((3, 5, 13), (3, 5, 13)),
        ((3, 5, 11), (3, 5, 11)),
    }
    check_against_reference(loss, w, x, 1.0)
    ws = jnp.asarray(rng.normal(size=(4, 13, 13)) / 4, jnp.float32)

    def stacked(ws, x):  # (4 layers under a scan: a Gram per layer and example)
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x[0], ws)
        return jnp.sum(h**2)

    g = optclip.clipped_grad(stacked, l2_clip_norm=1.0)
    shapes = {s for _, ss in grams_in(jax.make_jaxpr(g)(ws, x).jaxpr) for s in ss}
    assert shapes == {(4, 3, 5, 13)}, shapes
    check_against_reference(stacked, ws, x, 1.0)


@pytest.mark.every_case
@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("written", [(P.DEFAULT, P.HIGHEST), P.HIGH, "F32_F32_F32"])
def test_a_model_written_with_a_precision_matches_the_float64_reference(written, mode):
    # The Grams run at the precision read from the model (float32 products on this CPU at
    # every one of these): the norms and the clipped sum as the float64 reference's.
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 5, 3)), jnp.float32)
    loss = lambda w, x: jnp.sum(jnp.sin(jnp.dot(x, w, precision=written)))  # noqa: E731
    check_against_reference(loss, w, x, 0.5, mode=mode)


def test_an_embeddings_grams_are_exact_whatever_the_default_precision():
    # A lookup's gradient is a sum of output-gradient rows, no product: the Gram of those rows
    # is at HIGHEST; the dense layer after it (direct route: T (3 + 6) > 3 * 6) follows the
    # default.
    params = {"table": jnp.ones((7, 3)), "w": jnp.ones((3, 6))}
    loss = lambda p, ids: jnp.sum(jnp.sin(jnp.take(p["table"], ids, axis=0) @ p["w"]))  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    with jax.default_matmul_precision("bfloat16"):
        grams = grams_in(jax.make_jaxpr(g)(params, jnp.zeros((2, 5), jnp.int32)).jaxpr)
    found = {(p, tuple(s[-1] for s in shapes)) for p, shapes in grams}
    assert found == {((P.HIGHEST, P.HIGHEST), (3, 3)), ((P.DEFAULT, P.DEFAULT), (3, 6))}


@pytest.mark.parametrize("length", [5, 40])
def test_dense_layers_are_ghost_never_batch_by_weight(length):
    # Sequence 5: the Gram route (5 * (13 + 11) < 13 * 11 operations), nothing of shape
    # (B, 13, 11). Sequence 40: computing each example's 13 x 11 gradient and its squares takes
    # fewer operations than the Grams, and that (B, 13, 11) is smaller than the layer's inputs.
    rng = np.random.default_rng(7)
    params = {"w": jnp.asarray(rng.normal(size=(13, 11)), jnp.float32), "b": jnp.zeros(11)}
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)  # noqa: E731
    x = jnp.asarray(rng.normal(size=(3, length, 13)), jnp.float32)
    report = optclip.ghost_report(loss, params, x)
    assert report["['w']"].mode == "ghost" and report["['b']"].mode == "materialised"
    per_example_w = {(3, 13, 11), (3, 11, 13), (3, 1, 13, 11), (1, 3, 1, 13, 11)}
    for method, expected in (("auto", length == 40), ("vmap", True)):
        g = optclip.clipped_grad(loss, l2_clip_norm=1.0, method=method)
        jaxpr = jax.make_jaxpr(g)(params, x).jaxpr
        assert bool(shapes_in(jaxpr) & per_example_w) == expected, method
    check_against_reference(loss, params, x, 1.0)


# A dense site's clipped sum is one `dot_general` of its record and its weighted output
# gradient (`_products.dense_view_sum`), its dimension numbers worked out from the layer's: every
# arrangement of the weight's dimensions, on either side, with head (batch) dimensions, the
# record's free dimensions before or after those it contracts, in a scan (one weight per step,
# or the same weight at every step).
DENSE = {  # (weight shape, input shape of one example, the per-example product)
    "x @ w": ((4, 5), (1, 3, 4), lambda w, x: x @ w),
    "w first": ((5, 4), (1, 3, 4), lambda w, x: lax.dot_general(w, x, (([1], [2]), ([], [])))),
    "x @ w, narrowing": ((5, 4), (1, 3, 5), lambda w, x: x @ w),
    "w first, narrowing": (
        (4, 5),
        (1, 3, 5),
        lambda w, x: lax.dot_general(w, x, (([1], [2]), ([], []))),
    ),
    "heads": ((2, 2, 5), (1, 3, 2, 2), lambda w, x: jnp.einsum("bthc,hco->hbto", x, w)),
    "heads, w first": (
        (2, 5, 2),
        (1, 3, 2, 2),
        lambda w, x: lax.dot_general(w, x, (([2], [3]), ([0], [2]))),
    ),
    "two contracted": ((2, 2, 5), (1, 3, 2, 2), lambda w, x: jnp.einsum("bthc,hco->bto", x, w)),
    "contracted out of order": (
        (2, 2, 5),
        (1, 3, 2, 2),
        lambda w, x: lax.dot_general(x, w, (([3, 2], [0, 1]), ([], []))),
    ),
    "free after contracted": ((4, 5), (1, 4, 3), lambda w, x: jnp.einsum("bct,co->bto", x, w)),
    "stacked in a scan": (
        (3, 4, 4),
        (1, 2, 4),
        lambda w, x: lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0],
    ),
    "one weight at every step": (
        (4, 4),
        (1, 2, 4),
        lambda w, x: lax.scan(
            lambda h, _: (jnp.tanh(lax.dot(w, h[0].T).T[None]), None), x, None, 3
        )[0],
    ),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_every_arrangement_of_a_dense_layer(name, mode):
    w_shape, x_shape, product = DENSE[name]
    rng = np.random.default_rng(12)
    params = {"w": jnp.asarray(rng.normal(size=w_shape), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(5, *x_shape[1:])), jnp.float32)
    loss = lambda p, x: jnp.sum(jnp.sin(product(p["w"], x)))  # noqa: E731
    assert optclip.ghost_report(loss, params, x)["['w']"].mode == "ghost"
    check_against_reference(loss, params, x, 1.0, mode=mode)


@pytest.mark.parametrize("reverse", [True, False], ids=["reversed", "forward"])
def test_a_scanned_cells_input_is_its_records_in_either_direction(reverse, mode):
    """A weight reading a scan's ``xs`` (a cell's input, `_interpret._scan` takes the ``xs``
    as the record, not a stack of its steps) in a scan run backwards (a bidirectional RNN's
    second half) or forwards, unrolled by 2, its steps' outputs all read: the norms and sums
    against the float64 reference, with an example at 1e20 and one at 1e-20."""
    rng = np.random.default_rng(5)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 4)) / 2, jnp.float32),
        "u": jnp.asarray(rng.normal(size=(4, 4)) / 2, jnp.float32),
    }

    def loss(p, x):  # x: (1, T, 3)
        def step(h, x_t):
            h = jnp.tanh(x_t @ p["w"] + h @ p["u"])
            return h, h

        _, hs = lax.scan(step, jnp.zeros((1, 4)), jnp.swapaxes(x, 0, 1), reverse=reverse, unroll=2)
        return jnp.sum(jnp.sin(hs) + hs * jnp.arange(hs.shape[0])[:, None, None])

    x = rng.normal(size=(4, 5, 3)) * np.array([1, 1e20, 1e-20, 1])[:, None, None]
    x = jnp.asarray(x, jnp.float32)
    assert optclip.ghost_report(loss, params, x)["['w']"].mode == "ghost"
    check_against_reference(loss, params, x, 1.0, mode=mode)


# (the fast tier's case first: one XLA would be given the slower orientation)
@pytest.mark.parametrize("name", ["x @ w, narrowing", "w first, narrowing", "x @ w", "w first"])
def test_a_dense_sum_is_taken_with_its_larger_side_last(name):
    """`_products._larger_last`: the clipped sum's product comes out with the larger of the
    weight's two sides last (XLA's CPU runtime contracts two operands over their rows faster
    so), then is transposed into the weight's order where that differs; with fewer rows
    (examples and positions) than a side, in the weight's order (no copy of the weight's
    size). The sum is the reference's either way."""
    w_shape, x_shape, product = DENSE[name]
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=w_shape), jnp.float32)}
    loss = lambda p, x: jnp.sum(jnp.sin(product(p["w"], x)))  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    for batch, seq, oriented in ((6, 3, (4, 5)), (2, 1, w_shape)):  # (18 rows, then 2)
        x = jnp.asarray(rng.normal(size=(batch, *x_shape[1:])), jnp.float32)[:, :seq]
        jaxpr = jax.make_jaxpr(g)(params, x).jaxpr
        products = [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]
        shapes = [e.outvars[0].aval.shape for e in products]
        assert oriented in shapes and oriented[::-1] not in shapes, (batch, shapes)
        check_against_reference(loss, params, x, 1.0)


# (the fast tier's case first: a weight on the left, which the CPU could not run)
# (eagerly with the cast alone: CI's time, docs/design/tests-and-ci.md)
@pytest.mark.parametrize(
    ("cast", "mode"),
    [(True, "jit"), (False, "jit"), (True, "eager")],
    ids=["float32 cast to bfloat16-jit", "bfloat16-jit", "float32 cast to bfloat16-eager"],
)
@pytest.mark.parametrize("name", sorted(DENSE, key=lambda name: name != "heads, w first"))
def test_every_arrangement_of_a_dense_layer_in_bfloat16(name, cast, mode):
    """Each arrangement of `DENSE` computed in bfloat16: the weight in bfloat16, or in float32
    and cast by the model (Flax's ``dtype=jnp.bfloat16``). The clipped sums' products take
    bfloat16 operands to a float32 result, which XLA's CPU runtime refused for a weight on the
    left ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"): three of them.
    With a non-finite example (dropped) the sums are taken one example at a time, by the same
    product. (The GPU's branch, that product in bfloat16, does not run on a CPU.)"""
    w_shape, x_shape, product = DENSE[name]
    rng = np.random.default_rng(12)
    w = jnp.asarray(rng.normal(size=w_shape), jnp.float32 if cast else jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(5, *x_shape[1:])), jnp.bfloat16)
    loss = lambda p, x: jnp.sum(jnp.sin(product(p["w"].astype(x.dtype), x)).astype(jnp.float32))  # noqa: E731
    assert optclip.ghost_report(loss, {"w": w}, x)["['w']"].mode == "ghost"
    batches = [x, x.at[2].set(jnp.inf)]
    step = gm.assert_as_vmap_to_bfloat16_rounding_on_each(loss, {"w": w}, batches, 1.0, mode)
    if name in ("stacked in a scan", "one weight at every step"):
        return  # (layers in a chain: their output gradients are the chain's, in bfloat16)
    # Against float64: each example's gradient before its rounding, from the model's own
    # bfloat16 output gradient (``cos(y)``) and input, contracted in float64.
    ys = jax.vmap(lambda xb: product(w.astype(xb.dtype), xb))(x[:, None])
    outs = jax.vmap(jax.grad(lambda y: jnp.sum(jnp.sin(y).astype(jnp.float32))))(ys)
    with jax.enable_x64(True):  # (jitted: one program, where eagerly each operation is one)
        w64 = jnp.asarray(np.asarray(w, np.float64))
        vjp = lambda xb, o: jax.vjp(lambda v: product(v, xb), w64)[1](o)[0]  # noqa: E731
        xs, os = (np.asarray(a, np.float64) for a in (x[:, None], outs))
        per_example = np.asarray(jax.jit(jax.vmap(vjp))(xs, os))
    norms = np.sqrt(np.sum(per_example.reshape(5, -1) ** 2, axis=1))
    sums, aux = step({"w": w}, x, np.float32(1e30))  # (the helper's program)
    np.testing.assert_allclose(np.asarray(aux.grad_norms, np.float64), norms, rtol=RTOL)
    # (unclipped: the sum of the examples' gradients, rounded once to the leaf's dtype)
    total = np.sum(per_example, axis=0)
    got = np.asarray(sums["w"], np.float64)
    np.testing.assert_allclose(got, total, rtol=2.0**-8, atol=RTOL * np.max(np.abs(total)))


LOOKUPS = {
    "take": lambda w, ids: jnp.take(w, ids, axis=0),
    "index": lambda w, ids: w[ids],
    "vmapped": lambda w, ids: jax.vmap(jax.vmap(lambda i: w[i]))(ids),  # (Equinox's)
    "fill": lambda w, ids: w.at[ids].get(mode="fill", fill_value=0),
    "vmapped fill": lambda w, ids: jax.vmap(
        jax.vmap(lambda i: w.at[i].get(mode="fill", fill_value=0))
    )(ids),
    "clip": lambda w, ids: jnp.take(w, ids, axis=0, mode="clip"),
    "columns": lambda w, ids: jnp.moveaxis(w.T[:, ids], 0, -1),  # (the features first)
    # penzai's named-axis lookup: a scalar-id lookup vmapped over the table's feature axis (a
    # gather on the transposed table, its row dimension kept as size 1, `mode=CLIP`)
    "named axis": lambda w, ids: jax.vmap(
        jax.vmap(jax.vmap(lambda col, i: col[i], in_axes=(None, 0)), in_axes=(None, 0)),
        in_axes=(1, None),
        out_axes=-1,
    )(w, ids),
}


@pytest.mark.parametrize("name", list(LOOKUPS))
def test_each_way_of_writing_a_lookup_is_ghost(name, mode):
    # Ids out of range (7 and 9 of 7 rows; -1 counts from the end, -9 does not reach the
    # first row): `fill` reads a zero row, `clip` the nearest row, and the others (JAX's
    # promise that ids are in range) the nearest row too, but JAX's gradient of those drops
    # the row (JAX: "gradients will not be correct"), as every materialised gradient and the
    # clipped sums did. The norms read the nearest row there: the sums were clipped by norms
    # that counted a row the sums did not hold. (`take` fills with NaN: not tested here.)
    rng = np.random.default_rng(11)
    params = {"w": jnp.asarray(rng.normal(size=(7, 3)), jnp.float32)}
    ids = jnp.asarray(rng.integers(0, 7, size=(5, 4)))
    if name != "take":
        ids = ids.at[1, 2].set(7).at[3, 0].set(9).at[0, 1].set(-1).at[2, 3].set(-9)
    lookup = LOOKUPS[name]

    def loss(p, ids):
        return jnp.sum(jnp.sin(lookup(p["w"], ids) @ jnp.arange(3.0)) ** 2)

    assert optclip.ghost_report(loss, params, ids)["['w']"].mode == "ghost"
    check_against_reference(loss, params, ids, 1.0, mode=mode)


def test_report_names_each_leaf_and_why():
    loss, params, ids = gm.embedding(np.random.default_rng(8), tied=True)
    report = optclip.ghost_report(loss, params, ids)
    assert report["['embed']"].mode == "ghost"
    assert sorted(report["['embed']"].operations) == ["dot_general", "gather"]
    assert "cross terms" in report["['embed']"].reason
    loss, params, x = gm.fallback(np.random.default_rng(8))
    report = optclip.ghost_report(loss, params, x)
    assert report["['w']"].mode == "materialised" and "`sin`" in report["['w']"].reason
    assert report["['u']"].mode == "unused"
    assert "['w']" in str(report)


def _no_gradient_models(rng):
    """Losses that use a parameter where no gradient flows back, beside the dense uses that
    make its per-example gradient worth not forming: ``{name: (loss, has_aux, modes)}``, where
    `modes` are the ghost report's modes of the leaves `u` (dense, and in most models also used
    where no gradient flows) and `e` (only used there, or not at all)."""
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 3)) * 0.5, jnp.float32),
        "u": jnp.asarray(rng.normal(size=(3, 3)) * 0.5, jnp.float32),
        "e": jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(5, 2, 4)), jnp.float32)

    def frozen(p, x):  # a frozen table: stop_gradient
        h = jnp.tanh(x @ p["w"]) @ lax.stop_gradient(p["e"]).T
        return jnp.sum(h**2) + jnp.sum(h[..., :3] @ p["u"])

    def aux(p, x):  # a weight-decay term logged in `has_aux`'s output only
        h = jnp.tanh(x @ p["w"]) @ p["u"]
        return jnp.sum(h**2), {"decay": jnp.sum(p["u"] ** 2) + jnp.sum(p["e"] ** 2)}

    def tests(p, x):  # comparisons, a sign, an argmax, a rounding
        h = jnp.tanh(x @ p["w"])
        h = jnp.where(jnp.sum(p["u"]) > 0, h @ p["u"], h) * jnp.sign(p["e"][0])
        return jnp.sum(h**2) + jnp.sum(h * jnp.argmax(p["e"], axis=0) * jnp.round(p["e"][1]))

    @jax.jit
    def pair(u, e):  # a nested call with one output the gradient reaches
        return u.T, jnp.sum(e) + jnp.sum(u)

    def called(p, x):
        u, total = pair(p["u"], p["e"])
        h = jnp.tanh(x @ p["w"]) @ u.T
        return jnp.sum(jnp.where(total > 0, h, -h) ** 2)

    def scanned(p, x):  # a carry fed back to the loss through a later step; one that is not
        def step(carry, _):
            h, s, n = carry
            h2 = jnp.tanh(h @ p["u"]) + s
            return (h2, s @ p["u"], n @ lax.stop_gradient(p["e"]).T[:, :3] + n), h2

        zeros = jnp.zeros(x.shape[:-1] + (3,))
        start = (jnp.tanh(x @ p["w"]), zeros + 0.1, zeros[..., :6] + 1.0)
        (_, _, n), hs = lax.scan(step, start, None, length=3)
        return jnp.sum(hs**2), jnp.sum(n)

    def carried(p, x):  # a parameter carried by a scan, in a carry the loss does not read
        def step(carry, _):
            h, e = carry
            return (jnp.tanh(h @ p["u"]), jnp.sin(e)), None

        (h, _), _ = lax.scan(step, (jnp.tanh(x @ p["w"]), p["e"]), None, length=3)
        return jnp.sum(h**2)

    def twice(p, x):  # `u` read by each step, and also carried where the loss does not read
        def step(carry, _):
            h, u = carry
            return (jnp.tanh(h @ p["u"]), jnp.sin(u)), None

        (h, _), _ = lax.scan(step, (jnp.tanh(x @ p["w"]), p["u"]), None, length=3)
        return jnp.sum(h**2)

    ghost, unused = "ghost", "unused"
    models = {
        "frozen": (frozen, False, (ghost, unused)),
        "aux": (aux, True, (ghost, unused)),
        "tests": (tests, False, (ghost, unused)),
        "called": (called, False, (ghost, unused)),
        "scanned": (scanned, True, (ghost, unused)),
        "carried": (carried, False, (ghost, unused)),
        "twice": (twice, False, (ghost, unused)),
    }
    return models, params, x


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize(
    "name", ["frozen", "aux", "tests", "called", "scanned", "carried", "twice"]
)
def test_a_use_no_gradient_flows_back_from_is_no_site(name, mode):
    # A parameter used only where no gradient flows back to it (`stop_gradient`, comparisons,
    # `sign`, `argmax`, `round`, an output of a nested call the loss does not use, `has_aux`'s
    # outputs) has a zero gradient: it is `unused`, no per-example copy of it is formed (a
    # frozen embedding's would be a table per example), and a leaf used there and by a dense
    # layer stays ghost. Inside a scan, a carry the loss reads only through a later step
    # (`s`) is reached: `u`'s use on it counts; a parameter in a carry it does not reach is
    # no use, and the scan's dense layer stays ghost (both were materialised before), also
    # where that parameter is the one the steps read (`twice`: one variable passed to the
    # scan twice, reached at one position only).
    models, params, x = _no_gradient_models(np.random.default_rng(41))
    loss, has_aux, modes = models[name]
    report = optclip.ghost_report(loss, params, x, has_aux=has_aux)
    assert (report["['u']"].mode, report["['e']"].mode) == modes, str(report)
    assert report["['w']"].mode == "ghost"
    assert "no gradient reaches it" in report["['e']"].reason
    value = (lambda p, x: loss(p, x)[0]) if has_aux else loss
    g = optclip.clipped_grad(loss, has_aux=has_aux, l2_clip_norm=0.5, return_grad_norms=True)
    out, aux = run(g, mode)(params, x)
    norms, sums = gm.reference(value, params, x, 0.5)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL)
    assert_tree_close(out, sums)
    assert np.all(np.asarray(out["e"]) == 0)
    if has_aux:  # the auxiliary outputs are those of the materialising way
        v = optclip.clipped_grad(loss, has_aux=True, l2_clip_norm=0.5, method="vmap")
        assert_tree_close(run(g, mode)(params, x)[1].aux, run(v, mode)(params, x)[1].aux)


def _empty_models(rng):
    """Losses that use arrays with no entries, beside a dense layer or a lookup `v` that gives
    each example a gradient: ``{name: (loss, params, batch, modes)}``, where `modes` are the
    ghost report's modes of the leaves other than `v` (None: not asked). A product with an
    operand of no entries is zero whatever the other, and no gradient flows back through an
    array of no entries."""
    w = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)  # noqa: E731
    x = jnp.asarray(rng.normal(size=(5, 3, 6)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 7, size=(5, 4)))
    dense = lambda p, x: jnp.sum(jnp.sin(x @ p["v"]))  # noqa: E731
    lookup = lambda p, i: jnp.sum(p["v"][i] ** 2)  # noqa: E731
    conv = functools.partial(lax.conv_general_dilated, dimension_numbers=("NWC", "WIO", "NWC"))

    def scan(p, x):  # stacked blocks, none of them
        return lax.scan(lambda h, u: (jnp.tanh(h @ u), None), x, p["w"])[0]

    def carried(p, x):  # a loop of no steps that carries a parameter: passed through
        return lax.fori_loop(0, 0, lambda i, c: (jnp.tanh(c[0] @ c[1]), c[1]), (x, p["w"]))[0]

    def model(loss, batch=x, modes=("unused",), **shapes):
        v = w(7, 2) if batch is ids else w(6, 6)
        return loss, {"v": v, **{k: w(*shape) for k, shape in shapes.items()}}, batch, modes

    return {
        "an empty leaf": model(lambda p, x: dense(p, x) + jnp.sum(p["w"] ** 2), w=(0,)),
        "a dense layer of no inputs": model(
            lambda p, x: dense(p, x) + jnp.sum(jnp.sin(x[..., :0] @ p["w"])), w=(0, 3)
        ),
        "a dense layer of no outputs": model(
            lambda p, x: dense(p, x) + jnp.sum(x @ p["w"]), w=(6, 0)
        ),
        "an empty sequence": model(
            lambda p, x: dense(p, x) + jnp.sum(jnp.sin(x[:, :0] @ p["w"] + p["b"])),
            modes=("unused", "unused"),
            w=(6, 6),
            b=(6,),
        ),
        "no columns of a weight": model(
            lambda p, x: dense(p, x) + jnp.sum(jnp.sin(x @ p["w"][:, :0])) + jnp.sum(x @ p["w"]),
            modes=("ghost",),
            w=(6, 6),
        ),
        "an empty table": model(
            lambda p, i: lookup(p, i) + jnp.sum(jnp.sin(p["e"][i] @ p["w"])),
            ids,
            ("unused", "unused"),
            e=(7, 0),
            w=(0, 6),
        ),
        "no tokens": model(
            lambda p, i: lookup(p, i) + jnp.sum(jnp.sin(p["e"][i[:, :0]] @ p["w"])),
            ids,
            ("unused", "unused"),
            e=(7, 6),
            w=(6, 6),
        ),
        "a convolution of no output channels": model(
            lambda p, x: dense(p, x) + jnp.sum(conv(x, p["k"], (1,), "SAME") ** 2), k=(3, 6, 0)
        ),
        "a padded convolution of no input": model(
            lambda p, x: dense(p, x) + jnp.sum(jnp.cos(conv(x[:, :0], p["k"], (1,), [(2, 2)]))),
            k=(3, 6, 4),
        ),
        "an empty scale": model(
            lambda p, x: dense(p, x) + jnp.sum(jnp.sin(x[..., :0] * p["s"])), s=(0,)
        ),
        "a scan of no steps": model(
            lambda p, x: dense(p, x) + jnp.sum(jnp.sin(scan(p, x))), w=(0, 6, 6)
        ),
        "a loop of no steps carrying a parameter": model(
            lambda p, x: dense(p, x) + jnp.sum(jnp.sin(carried(p, x))), modes=None, w=(6, 6)
        ),
    }


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name", list(_empty_models(np.random.default_rng(0))))
def test_arrays_with_no_entries_contribute_nothing(name, mode):
    """A leaf with no entries, or used only on arrays with no entries, has a zero gradient
    (``unused``: its clipped sum is zeros of its shape), beside a ghost leaf `v`. The norms'
    checks took the logarithm of sizes of 0 and the largest of no entries ("math domain
    error", where `method="vmap"` and jax_privacy ran them)."""
    loss, params, x, modes = _empty_models(np.random.default_rng(5))[name]
    report = optclip.ghost_report(loss, params, x)
    assert report["['v']"].mode == "ghost"
    if modes is not None:
        assert tuple(r.mode for path, r in report.items() if path != "['v']") == modes, report
        unused = [r.reason for r in report.values() if r.mode == "unused"]
        assert all("arrays with no entries" in reason for reason in unused), report
    grads, _ = check_against_reference(loss, params, x, 0.5, mode=mode)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert shapes(grads) == shapes(params)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name", ["transformer", "recurrent"])
def test_a_batch_of_no_examples_sums_to_zeros(name, mode):
    """A batch with no examples: the clipped sum of none is zeros of each leaf's shape and
    dtype, with no norms, losses or aux outputs, as `method="vmap"` gives (jitted, the ghost
    way failed slicing one example out of none; jax_privacy refuses a batch of 0)."""
    loss, params, x = MODELS[name](np.random.default_rng(3))
    with_aux = lambda p, x: (loss(p, x), {"twice": 2 * loss(p, x)})  # noqa: E731
    kwargs = dict(l2_clip_norm=1.0, has_aux=True, return_values=True, return_grad_norms=True)
    outs = {}
    for method in ("auto", "vmap"):
        for micro in (None, 2):
            g = optclip.clipped_grad(with_aux, method=method, microbatch_size=micro, **kwargs)
            none = np.zeros(0, bool)
            outs[method, micro] = run(g, mode)(params, x[:0], is_padding_example=none)
    shapes = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    for grads, aux in outs.values():
        assert shapes(grads) == shapes(params)
        assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))
        assert aux.grad_norms.shape == aux.values.shape == aux.aux["twice"].shape == (0,)
        assert aux.grad_norms.dtype == jnp.float32
    assert shapes(outs["auto", None]) == shapes(outs["vmap", None])


def test_a_grouped_product_of_a_parameter_fails_as_jaxs_own_vmap():
    """`lax.ragged_dot` (a mixture of experts' grouped products) by a parameter: JAX 0.10
    batches it only with every operand batched along its first axis ("ragged_dot vmap over any
    dim but 0 - NYI"), so no per-example gradient of it can be formed by `jax.vmap`, nor by
    jax_privacy. `clipped_grad` raises JAX's own error, by either method; with a JAX that
    batches it, the results must be float64's."""
    rng = np.random.default_rng(9)
    params = {"w": jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(4, 3, 6)), jnp.float32)
    sizes = jnp.array([1, 2], jnp.int32)  # (rows of each example per expert)
    loss = lambda p, x: jnp.sum(jnp.sin(lax.ragged_dot(x[0], p["w"], sizes)))  # noqa: E731
    assert "ragged_dot" in optclip.ghost_report(loss, params, x)["['w']"].reason
    try:
        jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, x[:, None])
        refused = None
    except NotImplementedError as error:
        refused = str(error)
    for method in ("auto", "vmap"):
        if refused is None:
            check_against_reference(loss, params, x, 1.0, method)
            continue
        g = optclip.clipped_grad(loss, l2_clip_norm=1.0, method=method)
        with pytest.raises(NotImplementedError, match=re.escape(refused)):
            g(params, x)


def test_arguments_are_checked():
    loss = lambda w, x: jnp.sum(x * w)  # noqa: E731
    with pytest.raises(ValueError, match="`argnums` .* share"):
        optclip.clipped_grad(loss, argnums=1, l2_clip_norm=1.0)
    with pytest.raises(ValueError, match="`normalize_by` must be > 0, got 0"):
        optclip.clipped_grad(loss, l2_clip_norm=1.0, normalize_by=0)
    with pytest.raises(ValueError, match="`l2_clip_norm` must be >= 0"):
        optclip.clipped_grad(loss, l2_clip_norm=-1.0)
    with pytest.raises(ValueError, match="`method` must be one of 'auto', 'vmap'; got 'ghost'"):
        optclip.clipped_grad(loss, l2_clip_norm=1.0, method="ghost")
    with pytest.raises(TypeError, match="`batch_argnums` must be an int"):
        optclip.clipped_grad(loss, l2_clip_norm=1.0, batch_argnums="x")
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, batch_argnums=(1, 2))
    with pytest.raises(ValueError, match="share one batch size, got 3 .*; 2 "):
        g(jnp.ones(2), jnp.ones((3, 2)), jnp.ones((2, 2)))
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    with pytest.raises(ValueError, match="`is_padding_example` must be a bool array of shape"):
        g(jnp.ones(2), jnp.ones((3, 2)), is_padding_example=jnp.zeros(3))
    with pytest.raises(TypeError, match="real scalar loss"):
        optclip.clipped_grad(lambda w, x: x * w, l2_clip_norm=1.0)(jnp.ones(2), jnp.ones((3, 2)))
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, microbatch_size=2)
    with pytest.raises(ValueError, match="`microbatch_size` \\(2\\) must divide the batch"):
        g(jnp.ones(2), jnp.ones((3, 2)))


@pytest.mark.parametrize("method", ["auto", "vmap", "report"])
def test_arguments_that_cannot_be_differentiated_or_split_are_named(method):
    """Parameters that are not floating-point (an int, a bool, a key), a keyword argument with
    no batch axis, batch arguments that hold no arrays, `argnums` past the arguments given:
    each an error that names it, from both methods and `ghost_report` (they were IndexError,
    "data type <class 'numpy.int32'> not inexact", "Cannot interpret 'key<fry>' as a data
    type", or "share one batch size, got ."). No parameters at all: zeros, norms 0."""

    def loss(p, x, scale=1.0):
        return jnp.sum(jnp.sin(x @ p["w"])) * scale

    def call(fun, *args, argnums=0, **kwargs):
        if method == "report":
            return optclip.ghost_report(fun, *args, argnums=argnums, **kwargs)
        g = optclip.clipped_grad(
            fun, argnums, l2_clip_norm=1.0, method=method, return_grad_norms=True
        )
        return g(*args, **kwargs)

    params, x = {"w": jnp.ones((3, 2))}, jnp.ones((4, 3))
    for leaf, dtype in (
        (jnp.arange(3), "int32"),
        (np.array(True), "bool"),
        (2, "int32"),
        (jax.random.key(0), "key<fry>"),
    ):
        named = rf"argument 0: .*leaf `\[0\]\['n'\]` has dtype {dtype}"
        with pytest.raises(TypeError, match=named):
            call(loss, {**params, "n": leaf}, x)
    with pytest.raises(ValueError, match=r"keyword argument `\['scale'\]` is 0-d"):
        call(loss, params, x, scale=2.0)
    for empty in ({}, None, ()):
        with pytest.raises(ValueError, match="batch argument 1 holds no arrays"):
            call(lambda p, b: jnp.sum(p["w"]), params, empty)
    with pytest.raises(TypeError, match="`argnums` names argument 2, but .* given 2 positional"):
        call(lambda p, x, q: loss(p, x), params, x, argnums=2)
    if method != "report":
        grads, aux = call(lambda p, x: jnp.sum(x), {}, x)
        assert grads == {} and aux.grad_norms.shape == (4,) and np.all(aux.grad_norms == 0)


MULTIPLIERS = {  # (what multiplies the embedding, dense and output weights before their
    # layers, given the width `d` and `random_model`'s `number`)
    "none": lambda v, d, s: v,
    "written": lambda v, d, s: v * 0.5,
    "computed": lambda v, d, s: v * jnp.sqrt(1 / d),  # (muP's, computed while tracing)
    "negated": lambda v, d, s: -v,
    "apart": lambda v, d, s: v * 0.5,  # (and a tied table's output use by 1 / d: `OUTPUT`)
    "traced": lambda v, d, s: v * s,  # (an argument of the jitted step: `TRACED`)
}
TRACED = -0.75  # (the "traced" multiplier's value)
OUTPUT = {"apart": lambda d: 1 / d}  # (a tied table's output use scaled by its own number)


def random_model(draw_sizes, tied, scanned, magnitude, multiplier="none", number=TRACED):
    """A small random model: an embedding (tied to the output or not), dense layers with
    biases (stacked under a scan or not), LayerNorm-like scale; gradients scaled by
    `magnitude`; the weights scaled by one of `MULTIPLIERS` before their layers (a tied
    table's output use by `OUTPUT`'s number more, its two uses then scaled by two numbers;
    "traced" multiplies by `number`)."""
    vocab, d, t, layers, batch, seed = draw_sizes
    scale = lambda v, d: MULTIPLIERS[multiplier](v, d, number)  # noqa: E731
    rng = np.random.default_rng(seed)
    params = {
        "embed": jnp.asarray(rng.normal(size=(vocab, d)), jnp.float32),
        "w": jnp.asarray(rng.normal(size=(layers, d, d)) / np.sqrt(d), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(layers, d)), jnp.float32),
        "g": jnp.asarray(rng.normal(size=(d,)), jnp.float32),
    }
    if not tied:
        params["out"] = jnp.asarray(rng.normal(size=(d, vocab)), jnp.float32)

    def loss(p, ids):
        embed = scale(p["embed"], d)  # (one multiplier for both of a tied table's uses)
        h = jnp.take(embed, ids, axis=0)
        if scanned:
            h, _ = jax.lax.scan(
                lambda h, wb: (jnp.tanh(h @ scale(wb[0], d) + wb[1]), None), h, (p["w"], p["b"])
            )
        else:
            for i in range(layers):
                h = jnp.tanh(h @ scale(p["w"][i], d) + p["b"][i])
        tied_out = embed.T * OUTPUT[multiplier](d) if multiplier in OUTPUT else embed.T
        logits = (h * p["g"]) @ (tied_out if tied else scale(p["out"], d))
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0]) * magnitude

    ids = jnp.asarray(rng.integers(0, vocab, size=(batch, t)))
    return loss, params, ids


def drawn(sizes, tied, scanned, magnitude, clip, looped, multiplier="none"):
    """A hypothesis `example` of `test_random_models_match_the_float64_reference`'s arguments,
    in their order."""
    return example(
        sizes=sizes,
        tied=tied,
        scanned=scanned,
        magnitude=magnitude,
        clip=clip,
        looped=looped,
        multiplier=multiplier,
    )


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(
    sizes=st.tuples(
        st.integers(2, 9),
        st.integers(1, 6),
        st.integers(1, 5),
        st.integers(1, 3),
        st.integers(1, 5),
        st.integers(0, 2**31),
    ),
    tied=st.booleans(),
    scanned=st.booleans(),
    magnitude=st.sampled_from([1.0, 1e-3, 1e20, 1e-20]),
    clip=st.sampled_from([0.1, 1.0, 1e30]),
    looped=st.booleans(),
    multiplier=st.sampled_from(list(MULTIPLIERS)),
)
@drawn((2, 6, 1, 2, 4, 923738), True, False, 1.0, 0.1, False)
@drawn((2, 1, 1, 1, 1, 0), False, False, 1e-20, 0.1, True)
@drawn((6, 2, 1, 1, 1, 345533), False, False, 1.0, 0.1, False)
# (every weight scaled by a computed number: a tied table, stacked layers)
@drawn((5, 4, 3, 2, 3, 7), True, True, 1e-20, 0.1, True, "computed")
# (a tied table's uses scaled by two numbers; every weight by a number the step traces)
@drawn((5, 4, 3, 2, 3, 8), True, False, 1e20, 0.1, False, "apart")
@drawn((5, 4, 3, 2, 3, 9), True, True, 1.0, 0.1, True, "traced")
def test_random_models_match_the_float64_reference(
    sizes, tied, scanned, magnitude, clip, looped, multiplier
):
    """Random models against float64, their weights scaled by a multiplier or not (a tied
    table's two uses by two numbers: "apart"; a number the jitted step traces: "traced");
    every weight goes ghost (the biases and the LayerNorm-like scale are materialised)."""
    from optclip.per_example.ghost import _norms

    loss, params, ids = random_model(sizes, tied, scanned, magnitude, multiplier)
    make, reports = None, []
    if multiplier == "traced":  # (the number an argument of the jitted step; the report
        # taken while the step is traced, as the step sees the number)
        make = lambda s: random_model(sizes, tied, scanned, magnitude, multiplier, s)[0]  # noqa: E731
        traced = lambda s: reports.append(optclip.ghost_report(make(s), params, ids)) or s  # noqa: E731
        jax.eval_shape(traced, jnp.float32(TRACED))
    report = reports[0] if reports else optclip.ghost_report(loss, params, ids)
    modes = {k: r.mode for k, r in report.items()}
    weights = {k for k in modes if k in ("['embed']", "['out']", "['w']")}
    assert {modes[k] for k in weights} == {"ghost"}, modes
    loop_work = _norms.LOOP_WORK
    _norms.LOOP_WORK = 0 if looped else loop_work  # (the norms one example at a time)
    try:
        _check_random_model(make or loss, params, ids, clip, magnitude, make is not None)
    finally:
        _norms.LOOP_WORK = loop_work


def _shared_models(rng):
    """Losses with a site whose operands are the same for every example (its output shared by
    the batch under `jax.vmap`): ``{name: (loss, params, x)}``."""
    t, d, vocab = 4, 3, 7
    ids = jnp.asarray(rng.integers(0, vocab, size=(5, t)))
    tables = {
        "tok": jnp.asarray(rng.normal(size=(vocab, d)), jnp.float32),
        "pos": jnp.asarray(rng.normal(size=(t, d)), jnp.float32),
        "out": jnp.asarray(rng.normal(size=(d, vocab)), jnp.float32),
    }

    def positions(p, ids):  # learned positions, looked up as GPT-2 does
        h = p["tok"][ids] + p["pos"][jnp.arange(ids.shape[-1])]
        return jnp.sum(jax.nn.log_softmax(jnp.tanh(h) @ p["out"])[..., 0])

    dense = {
        "w": jnp.asarray(rng.normal(size=(4, 3)) * 0.5, jnp.float32),
        "u": jnp.asarray(rng.normal(size=(3, 3)) * 0.5, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(5, 2, 4)), jnp.float32)

    def constant(p, x):  # a dense layer applied to a constant, and the same layer to h
        h = jnp.tanh(x @ p["w"])
        c = jnp.arange(6.0).reshape(h.shape) / 6
        return jnp.sum((jnp.tanh(h @ p["u"]) + c @ p["u"]) ** 2)

    def carried(p, x):  # a scan's carry the same for every example, fed through `u`
        def step(carry, _):
            h, s = carry
            h = jnp.tanh(h @ p["u"]) + s
            return (h, s @ p["u"]), h

        start = (jnp.tanh(x @ p["w"]), jnp.full(x.shape[:-1] + (3,), 0.1))
        return jnp.sum(lax.scan(step, start, None, length=3)[1] ** 2)

    @jax.custom_jvp
    def twice(h, c):
        return 2 * h, 2 * c

    twice.defjvp(lambda primals, tangents: (twice(*primals), twice(*tangents)))

    @jax.custom_vjp
    def halved(h, c):
        return h / 2, c / 2

    halved.defvjp(lambda h, c: (halved(h, c), None), lambda _, g: (g[0] / 2, g[1] / 2))

    def through(p, x, how):  # an operation given h and a constant c returns c's share apart
        h = jnp.tanh(x @ p["w"])
        c = jnp.full(h.shape, 0.1)
        if how == "cond":  # (its index the same for every example)
            h, c = lax.cond(x.shape[0] > 0, lambda h, c: (h, 2 * c), lambda h, c: (-h, c), h, c)
        elif how == "custom_jvp":
            h, c = twice(h, c)
        elif how == "custom_vjp":
            h, c = halved(h, c)
        else:  # a while loop (no gradient through it: JAX has no reverse mode of one)
            _, n, c = lax.while_loop(
                lambda s: s[0] < 2,
                lambda s: (s[0] + 1, 0.5 * s[1], s[2] + 1),
                (0, lax.stop_gradient(h), c),
            )
            h = h + n
        return jnp.sum((jnp.tanh(h @ p["u"]) + c @ p["u"]) ** 2)

    return {
        "positions": (positions, tables, ids),
        "constant": (constant, dense, x),
        "carried": (carried, dense, x),
        **{
            how: (functools.partial(through, how=how), dense, x)
            for how in ("cond", "custom_jvp", "custom_vjp", "while")
        },
    }


@pytest.mark.parametrize("way", ["jit", "eager", "gpu"])
@pytest.mark.parametrize(
    "name", ["positions", "constant", "carried", "cond", "custom_jvp", "custom_vjp", "while"]
)
def test_a_site_shared_by_the_batch_has_each_examples_output_gradient(name, way, monkeypatch):
    # Where a site's operands are the same for every example (positions looked up at
    # `jnp.arange(T)`, a dense layer applied to a constant, a scan's carry that no example
    # changes, a constant passed through a `cond`, a custom JVP or VJP or a `while` beside
    # the example's values), `jax.vmap` shares its output across the batch, and its gradient
    # was every example's summed: each example's norm and clipped sum were wrong (the
    # positions' sum by 4x) with no error. Also with an example dropped for a non-finite
    # input (the sums one example at a time).
    if way == "gpu":
        gm.take_gpu_branches(monkeypatch)
    loss, params, x = _shared_models(np.random.default_rng(43))[name]
    assert all(r.mode == "ghost" for r in optclip.ghost_report(loss, params, x).values())
    check_against_reference(loss, params, x, 0.5, mode="eager" if way == "eager" else "jit")
    if name == "positions":
        return
    g = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True)
    grads, aux = run(g, "eager" if way == "eager" else "jit")(params, x.at[1, 0, 0].set(jnp.inf))
    assert not np.isfinite(aux.grad_norms[1])
    _, sums = gm.reference(loss, params, np.delete(np.asarray(x), 1, axis=0), 0.5)
    assert_tree_close(grads, sums)


def _check_random_model(loss, params, ids, clip, magnitude, traced=False):
    # A tied embedding's two uses may nearly cancel: the Gram route's error is relative to the
    # uses' norms, squared (hypothesis found 1.03e-5 on a norm 25x below the batch's largest).
    # A small leaf of a random model may carry the float32 model's own rounding (1.3e-5 of an
    # embedding's largest entry, 160x below the sum's; the same with method="vmap").
    number = TRACED if traced else None  # (`loss` then makes the loss from the number)
    check_against_reference(
        loss, params, ids, clip * magnitude, norm_floor=1e-6, whole=True, traced=number
    )


@pytest.fixture
def ghost_multidevice():
    """`ghost_multidevice.py`'s run in its own process (JAX fixes its device count at start),
    started by conftest.py as soon as the tests were collected."""
    return launch.finish(launch.start_ghost_multidevice(), launch.GHOST_TIMEOUT_S)


@pytest.mark.slow
def test_a_batch_sharded_over_eight_devices(ghost_multidevice):
    """The ghost engine on 8 CPU devices, under both meshes, against one device."""
    done = ghost_multidevice
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout
    assert "mlp/Explicit/spmd_axis_name" in done.stdout
    for huge in ("mlp/Explicit/huge/spmd_axis_name", "transformer/Auto/huge/spmd_axis_name"):
        assert huge in done.stdout, done.stdout
    for scaled in ("mlp/Explicit/scaled/vmap", "transformer/Auto/scaled/parameters split"):
        assert scaled in done.stdout, done.stdout
        assert scaled.replace("scaled", "traced") in done.stdout, done.stdout
    for classic in ("no mesh context", "parameters split"):  # (not under `jax.set_mesh`)
        assert f"transformer/Auto/{classic}" in done.stdout, done.stdout
        assert f"transformer/Auto/held/{classic}" in done.stdout, done.stdout
    for conv in ("conv/Auto/spmd_axis_name", "conv/Auto/no mesh context"):
        assert conv in done.stdout, done.stdout
        assert conv.replace("conv", "product") in done.stdout, done.stdout
    for gru in ("gru/Auto/spmd_axis_name", "gru/Auto/huge/spmd_axis_name"):
        assert gru in done.stdout, done.stdout


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_weight_held_by_a_sharding_constraint_stays_ghost(mode):
    """`with_sharding_constraint` on a weight (where it is held: FSDP code gathers each weight
    whole before its layer), outside a scan and on each layer's slice inside one: a view, as a
    dtype conversion is (each use was materialised, a weight per example)."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))
    held = lambda a: lax.with_sharding_constraint(a, NamedSharding(mesh, PartitionSpec()))  # noqa: E731
    rng = np.random.default_rng(17)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 6, 6)) * 0.5, jnp.float32),
        "v": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(5, 2, 6)), jnp.float32)

    def loss(p, x):
        h = lax.scan(lambda h, w: (jnp.tanh(h @ held(w)), None), x, p["w"])[0]
        return jnp.sum(jnp.sin(h @ held(p["v"])))

    names = {e.primitive.name for e in jax.make_jaxpr(loss)(params, x[:1]).eqns}
    assert "sharding_constraint" in names  # (not dropped while tracing: the test is of it)
    report = optclip.ghost_report(loss, params, x)
    assert [r.mode for r in report.values()] == ["ghost", "ghost"], report
    check_against_reference(loss, params, x, 1.0, mode=mode)


def _scaled_models(rng):
    """Losses whose weights are scaled by a number written in the loss, named for a
    rematerialisation policy, or passed through an optimization barrier before their layer:
    ``{name: (loss, params, batch, the report's mode of the weight, its reason's end)}``."""
    w = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)  # noqa: E731
    x = jnp.asarray(rng.normal(size=(5, 3, 6)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 7, size=(5, 4)))
    conv = functools.partial(lax.conv_general_dilated, dimension_numbers=("NWC", "WIO", "NWC"))
    dense = lambda f: (lambda p, x: jnp.sum(jnp.sin(x @ f(p["w"]))), (6, 6))  # noqa: E731
    # (linear in the product: a sine of 1e25 is not float64's in float32)
    linear = lambda f: (lambda p, x: jnp.sum((x @ f(p["w"])) * x), (6, 6))  # noqa: E731
    barrier = lambda v: lax.optimization_barrier((v, 0.0))[0]  # noqa: E731
    policy = jax.checkpoint_policies.save_only_these_names("w")

    def named(p, x):  # (a block under `remat` whose policy saves the named weight)
        block = lambda h, v: jnp.tanh(h @ checkpoint_name(v, "w"))  # noqa: E731
        return jnp.sum(jax.checkpoint(block, policy=policy)(x, p["w"]))

    def stacked(p, x):  # each layer's slice scaled inside the scan
        return jnp.sum(lax.scan(lambda h, v: (jnp.tanh(h @ (v * 0.3)), None), x, p["w"])[0])

    def tied(p, x):  # two uses, one scale: the cross term scaled by its square
        v = p["w"] * 0.5
        return jnp.sum(jnp.sin(jnp.tanh(x @ v) @ v.T))

    def unequal(p, x):  # two uses, two scales: the cross term scaled by their product
        return jnp.sum(jnp.sin(jnp.tanh(x @ (p["w"] * 0.5)) @ p["w"]))

    def opposite(p, x):  # two scales of opposite signs: the cross term's sign turns
        return jnp.sum(jnp.sin(jnp.tanh(x @ (p["w"] * -2.0)) @ (p["w"] * 0.25)))

    def far_apart(p, x):  # a huge number beside the weight as it is, the first use's
        # gradient zero for some examples: there the second's terms must not be shifted by
        # the first's power of two (they would flush: a norm of 0)
        kept = (jnp.sum(x) > 0).astype(x.dtype)
        return jnp.sum(((x * kept) @ (p["w"] * 1e20)) * x) + jnp.sum(jnp.sin(x @ p["w"]))

    def tied_output(p, i):  # a tied embedding whose output use carries muP's multiplier
        return jnp.sum(jnp.sin(jnp.tanh(p["w"][i]) @ (p["w"].T * 0.125)))

    held = jnp.asarray(0.375, jnp.float32)  # (a constant the loss holds: the jaxpr's const)
    rooted = jax.jit(lambda v, x: x @ (v * lax.rsqrt(jnp.float32(4))))  # (computed in a call)
    scaled = jax.jit(lambda v, x, s: x @ (v * s))  # (passed to a call)

    def stacked_computed(p, x):  # computed outside the scan: the body's const
        s = 1 / jnp.sqrt(4.0)
        return jnp.sum(lax.scan(lambda h, v: (jnp.tanh(h @ (v * s)), None), x, p["w"])[0])

    def by_the_data(p, x):  # a different number for each example: a site
        return jnp.sum(jnp.sin(x @ (p["w"] * jnp.mean(x))))

    models = {
        "times": (*dense(lambda v: v * 0.5), "ghost", "scaled by 0.5"),
        "times on the left": (*dense(lambda v: 2.0 * v), "ghost", "scaled by 2"),
        "divided": (*dense(lambda v: v / 3.0), "ghost", "scaled by 0.333333"),
        "negated and transposed": (*dense(lambda v: -v.T), "ghost", "scaled by -1"),
        "a chain": (*dense(lambda v: (-(v * 0.5) / 4.0).T), "ghost", "scaled by -0.125"),
        "huge": (*linear(lambda v: v * 1e25), "ghost", "scaled by 1e+25"),
        "tiny": (*linear(lambda v: v * np.float32(1e-25)), "ghost", "scaled by 1e-25"),
        "behind a barrier": (*dense(barrier), "ghost", "dense"),
        "named": (named, (6, 6), "ghost", "dense"),
        "stacked": (stacked, (3, 6, 6), "ghost", "scaled by 0.3"),
        "tied": (tied, (6, 6), "ghost", "with cross terms, scaled by 0.5"),
        "unequal": (unequal, (6, 6), "ghost", "each use scaled by its own number (0.5, 1)"),
        "opposite signs": (opposite, (6, 6), "ghost", "its own number (-2, 0.25)"),
        "far apart": (far_apart, (6, 6), "ghost", "each use scaled by its own number (1e+20, 1)"),
        "tied, the output scaled": (tied_output, (7, 6), "ghost", "own number (1, 0.125)"),
        "a computed root": (*dense(lambda v: v * jnp.sqrt(1 / 64)), "ghost", "scaled by 0.125"),
        "divided by a root": (*dense(lambda v: v / jnp.sqrt(16)), "ghost", "scaled by 0.25"),
        "a held constant": (*dense(lambda v: v * held), "ghost", "scaled by 0.375"),
        "a helper's number": (*dense(lambda v: v * jnp.clip(0.3, 0, 1)), "ghost", "by 0.3"),
        "a huge computed": (*linear(lambda v: v * jnp.power(10.0, 25.0)), "ghost", "by 1e+25"),
        "computed in a call": (
            lambda p, x: jnp.sum(jnp.sin(rooted(p["w"], x))),
            (6, 6),
            "ghost",
            "scaled by 0.5",
        ),
        "passed to a call": (
            lambda p, x: jnp.sum(jnp.sin(scaled(p["w"], x, jnp.sqrt(jnp.float32(0.25))))),
            (6, 6),
            "ghost",
            "scaled by 0.5",
        ),
        "stacked, computed outside": (stacked_computed, (3, 6, 6), "ghost", "scaled by 0.5"),
        "by the data": (by_the_data, (6, 6), "materialised", "elementwise `mul`"),
        "a table": (
            lambda p, i: jnp.sum(jnp.sin((p["w"] * 2.0)[i])),
            (7, 6),
            "ghost",
            "scaled by 2",
        ),
        "a kernel": (
            lambda p, x: jnp.sum(jnp.sin(conv(x, p["w"] * 0.5, (1,), "SAME"))),
            (3, 6, 4),
            "ghost",
            "scaled by 0.5",
        ),
    }
    return {
        name: (loss, {"w": w(*shape)}, ids if shape == (7, 6) else x, mode, why)
        for name, (loss, shape, mode, why) in models.items()
    }


# Every model jitted; eagerly, one of each kind of number (written, huge, none, two uses,
# computed, held, the data's): CI's time, docs/design/tests-and-ci.md.
SCALED_EAGER = ["times", "huge", "behind a barrier", "tied, the output scaled"]
SCALED_EAGER += ["a computed root", "a held constant", "by the data"]


@pytest.mark.parametrize(
    ("name", "mode"),
    [(n, "jit") for n in _scaled_models(np.random.default_rng(0))]
    + [(n, "eager") for n in SCALED_EAGER],
)
def test_a_weight_scaled_named_or_behind_a_barrier_stays_ghost(name, mode):
    """A weight multiplied or divided by a number written in the loss, or negated (muP's and
    an equalised learning rate's multipliers), is a view: its norm is the number's absolute
    value times the view's, exact where the squares overflow or flush ("huge", "tiny"); two
    uses keep their cross term, scaled by the product of their numbers (with its sign, and
    exact where one number is huge and the other 1: "far apart"). So is a number the loss
    computes from written numbers and constants it holds (``jnp.sqrt(1 /
    d)``, in a call, passed to one, into a scan), but not one that differs by example. A weight
    named for a rematerialisation policy (`checkpoint_name`) or behind an
    `optimization_barrier` is the weight itself. Each was materialised, a weight per example."""
    loss, params, batch, expected, why = _scaled_models(np.random.default_rng(43))[name]
    report = optclip.ghost_report(loss, params, batch)
    assert (report["['w']"].mode, why in report["['w']"].reason) == (expected, True), str(report)
    check_against_reference(loss, params, batch, 1.0, mode=mode)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("number", ["w / 0", "w * inf", "w * nan"])
def test_a_division_by_zero_or_a_number_not_finite_is_no_scaling(number, mode):
    """Such a "scale" is left to JAX (a site: the weight materialised), so that its
    infinities and NaNs are JAX's own: the same norms and sums as the materialising way."""
    scale = {"w / 0": lambda w: w / 0.0, "w * inf": lambda w: w * np.inf}.get(
        number, lambda w: w * np.nan
    )
    loss = lambda p, x: jnp.sum(jnp.sin(x @ scale(p["w"])))  # noqa: E731
    params, x = {"w": jnp.ones((3, 2))}, jnp.ones((4, 3))
    assert optclip.ghost_report(loss, params, x)["['w']"].mode == "materialised"
    out = {}
    for method in ("auto", "vmap"):
        g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True, method=method)
        out[method] = run(g, mode)(params, x)
    np.testing.assert_array_equal(out["auto"][1].grad_norms, out["vmap"][1].grad_norms)
    np.testing.assert_array_equal(out["auto"][0]["w"], out["vmap"][0]["w"])


GRADIENT_MODELS = ["mlp", "sequence", "embedding", "fallback", "scanned", "recurrent"]
GRADIENT_MODELS += ["sliced", "transformer", "conv", "conv_shared"]


GRADIENT_VARIANTS = ["clipped", "a zero example", "padding", "huge", "looped"]


# Each model clipped and with a zero example (the NaN this test exists for); every variant on
# a dense and a scanned model; eagerly on the dense one (CI's time: docs/design/tests-and-ci.md).
@pytest.mark.parametrize(
    ("name", "variant", "mode"),
    [
        (n, v, "jit")
        for n in GRADIENT_MODELS
        for v in GRADIENT_VARIANTS
        if n in ("mlp", "scanned")
        or v in ("clipped", "a zero example")
        or (n, v) == ("conv", "looped")  # (each example's convolved leaves in turn)
    ]
    + [("mlp", "a zero example", "eager")],
)
def test_the_gradient_through_the_clip_is_the_materialising_ways(name, variant, mode):
    """`jax.grad` of a function of the clipped sum and the norms (a meta-objective, a penalty
    on the private gradient) through the clip factors, as ``method="vmap"`` and jax_privacy
    differentiate it: the ghost way held the factors fixed (`stop_gradient`, a relic of a
    second backward pass), a different gradient, and with the factors differentiated an
    example of zero gradient made it NaN (the root's and the exponent shift's derivatives at
    0: `_norms.root`, `_sums.scaled`). With a zero example, a padding one, inputs whose
    squares overflow, and the norms one example at a time."""
    from optclip.per_example.ghost import _norms

    loss, params, x = getattr(gm, name)(np.random.default_rng(51))
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    if variant == "a zero example" and floating:
        x = x.at[0].set(0.0)
    if variant == "huge" and floating:
        x = x * 1e18
    padding = (jnp.arange(x.shape[0]) == 1) if variant == "padding" else None
    out = {}
    for method in ("auto", "vmap"):
        # (the batch an argument: a model's clipped, zero-example and huge variants compile
        # one program, which the later ones read from the compilation cache)
        def objective(p, x, method=method):
            g = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True, method=method)
            grads, aux = g(p, x, is_padding_example=padding)
            total = sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(grads))
            return total + jnp.sum(jnp.sqrt(aux.grad_norms + 1.0))

        loop_work = _norms.LOOP_WORK
        _norms.LOOP_WORK = 0 if variant == "looped" else loop_work
        try:
            # (the materialising way, the reference, jitted: eagerly it is the slowest part)
            out[method] = run(jax.grad(objective), mode if method == "auto" else "jit")(params, x)
        finally:
            _norms.LOOP_WORK = loop_work
    for a, b in zip(jax.tree.leaves(out["auto"]), jax.tree.leaves(out["vmap"]), strict=True):
        assert np.all(np.isfinite(np.asarray(a))), out["auto"]
        scale = float(np.max(np.abs(np.asarray(b))))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6 * scale)


def _traced_models(rng):
    """Losses whose weights are scaled by a number `s` the caller traces (an argument of the
    step the loss closes over: a scheduled multiplier): ``{name: (make, params, batch, s, the
    report's mode, its reason's end)}``, ``make(s)`` the loss."""
    w = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.5, jnp.float32)  # noqa: E731
    x = jnp.asarray(rng.normal(size=(5, 3, 6)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 7, size=(5, 4)))
    conv = functools.partial(lax.conv_general_dilated, dimension_numbers=("NWC", "WIO", "NWC"))
    dense = lambda f: lambda s: lambda p, x: jnp.sum(jnp.sin(x @ f(p["w"], s)))  # noqa: E731
    linear = lambda f: lambda s: lambda p, x: jnp.sum((x @ f(p["w"], s)) * x)  # noqa: E731
    traced = "scaled by a number traced outside the loss"
    some = "some traced outside the loss"

    def tied(s):  # two uses of one scaled view: the cross term scaled by its square
        def loss(p, x):
            v = p["w"] * s
            return jnp.sum(jnp.sin(jnp.tanh(x @ v) @ v.T))

        return loss

    def stacked(s):  # each layer's slice scaled inside the scan (the number a scan const)
        return lambda p, x: jnp.sum(
            lax.scan(lambda h, v: (jnp.tanh(h @ (v * s)), None), x, p["w"])[0]
        )

    def two_numbers(s):  # two uses, two traced numbers: the cross term times their product
        return lambda p, x: jnp.sum(jnp.sin(jnp.tanh(x @ (p["w"] * s)) @ (p["w"] * (2 * s))))

    def and_written(s):  # one use traced, the other scaled by a written number
        return lambda p, x: jnp.sum(jnp.sin(jnp.tanh(x @ (p["w"] * s)) @ (p["w"] * 0.5)))

    def and_the_weight(s):  # one use traced (huge, zero for some examples), the other the
        # weight as it is (as "far apart" in `_scaled_models`)
        def loss(p, x):
            kept = (jnp.sum(x) > 0).astype(x.dtype)
            return jnp.sum(((x * kept) @ (p["w"] * s)) * x) + jnp.sum(jnp.sin(x @ p["w"]))

        return loss

    models = {
        "times": (dense(lambda v, s: v * s), (6, 6), 0.75, "ghost", traced),
        "negative": (dense(lambda v, s: s * v), (6, 6), -2.0, "ghost", traced),
        "zero": (dense(lambda v, s: v * s), (6, 6), 0.0, "ghost", traced),
        "divided": (dense(lambda v, s: v / s), (6, 6), 3.0, "ghost", traced),
        "computed from it": (
            dense(lambda v, s: v * lax.rsqrt(jnp.abs(s) + 1.0)),
            (6, 6),
            -3.0,
            "ghost",
            traced,
        ),
        "with written ones": (
            dense(lambda v, s: (-(v * 0.5) * s / 4.0).T),
            (6, 6),
            0.75,
            "ghost",
            traced,
        ),
        "huge": (linear(lambda v, s: v * s), (6, 6), 1e25, "ghost", traced),
        "tiny": (linear(lambda v, s: v * s), (6, 6), 1e-25, "ghost", traced),
        "tied": (tied, (6, 6), 0.5, "ghost", "with cross terms, " + traced),
        "stacked": (stacked, (3, 6, 6), 0.3, "ghost", traced),
        "two numbers": (two_numbers, (6, 6), 0.5, "ghost", "own number, " + some),
        "and a written one": (and_written, (6, 6), -3.0, "ghost", "own number, " + some),
        "and the weight": (and_the_weight, (6, 6), 1e20, "ghost", "own number, " + some),
        "a table": (
            lambda s: lambda p, i: jnp.sum(jnp.sin((p["w"] * s)[i])),
            (7, 6),
            2.0,
            "ghost",
            traced,
        ),
        "a kernel": (
            lambda s: lambda p, x: jnp.sum(jnp.sin(conv(x, p["w"] * s, (1,), "SAME"))),
            (3, 6, 4),
            0.5,
            "ghost",
            traced,
        ),
    }
    return {
        name: (make, {"w": w(*shape)}, ids if name == "a table" else x, s, mode, why)
        for name, (make, shape, s, mode, why) in models.items()
    }


@pytest.mark.parametrize("name", list(_traced_models(np.random.default_rng(0))))
def test_a_scale_traced_outside_the_loss_stays_ghost(name):
    """A number the caller's `jit` traces (an argument of the step the loss closes over) is
    the same for every example: the weight it scales is a view, its norm scaled on the device
    by the number's value (exact where the squares overflow or flush: "huge", "tiny"), the
    sums and norms the float64 reference's for that number. It was materialised, a weight per
    example."""
    make, params, batch, s, expected, why = _traced_models(np.random.default_rng(45))[name]
    reports = []

    def step(params, batch, s):
        reports.append(optclip.ghost_report(make(s), params, batch)["['w']"])
        g = optclip.clipped_grad(make(s), l2_clip_norm=1.0, return_grad_norms=True)
        return g(params, batch)

    grads, aux = jax.jit(step)(params, batch, jnp.float32(s))
    assert (reports[0].mode, why in reports[0].reason) == (expected, True), reports[0]
    norms, sums = gm.reference(make(s), params, batch, 1.0)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL)
    assert_tree_close(grads, sums)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_scale_passed_to_the_loss_unbatched_stays_ghost(mode):
    """A multiplier passed to the loss as an argument that is neither batched nor
    differentiated (``clipped_grad(loss)(params, x, s)``, ``batch_argnums=1``) is the same for
    every example: a scale (an array traced, jitted or eagerly; a Python number compiled in),
    the sums and norms the float64 reference's. It was materialised."""
    make, params, x, _, _, _ = _traced_models(np.random.default_rng(52))["times"]
    loss = lambda p, x, s: make(s)(p, x)  # noqa: E731
    for s, why in ((jnp.float32(-0.75), "scaled by -0.75"), (0.5, "scaled by 0.5")):
        report = optclip.ghost_report(loss, params, x, s)["['w']"]
        assert (report.mode, report.reason.endswith(why)) == ("ghost", True), report
        g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
        grads, aux = run(g, mode)(params, x, s)
        norms, sums = gm.reference(make(float(s)), params, x, 1.0)
        np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL)
        assert_tree_close(grads, sums)


def test_a_traced_scale_in_the_callers_loops_and_microbatches():
    """The number traced by the caller's `lax.scan` (gradient accumulation whose multiplier is
    the carry), and a traced number with `microbatch_size` (the engine's own scan): each
    microbatch's sums and norms the float64 reference's for its number."""
    make, params, x, _, _, _ = _traced_models(np.random.default_rng(47))["times"]
    parts = x[:4].reshape(2, 2, *x.shape[1:])  # (two microbatches of two examples)

    def accumulate(params, parts, s):
        def body(s, part):
            g = optclip.clipped_grad(make(s), l2_clip_norm=1.0, return_grad_norms=True)
            return s * 2.0, g(params, part)

        return lax.scan(body, s, parts)[1]

    grads, aux = jax.jit(accumulate)(params, parts, jnp.float32(0.5))
    for i, s in enumerate((0.5, 1.0)):
        norms, sums = gm.reference(make(s), params, parts[i], 1.0)
        np.testing.assert_allclose(np.asarray(aux.grad_norms[i]), norms, rtol=RTOL)
        assert_tree_close({"w": grads["w"][i]}, sums)
    g = lambda s: optclip.clipped_grad(  # noqa: E731
        make(s), l2_clip_norm=1.0, return_grad_norms=True, microbatch_size=1
    )
    grads, aux = jax.jit(lambda p, x, s: g(s)(p, x))(params, x[:2], jnp.float32(-1.5))
    norms, sums = gm.reference(make(-1.5), params, x[:2], 1.0)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL)
    assert_tree_close(grads, sums)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_scale_of_each_model_jax_vmap_trains_stays_ghost(mode):
    """Numbers `jax.vmap` maps over, one per model (an `axis_index` computed outside the loss,
    and a batch of multipliers): traced, even eager, the same for every example of a model;
    each model's sums and norms the float64 reference's for its own number."""
    rng = np.random.default_rng(48)
    params = {"w": jnp.asarray(rng.normal(size=(3, 6, 5)) * 0.5, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(3, 4, 2, 6)), jnp.float32)
    scaled = lambda s: lambda p, x: jnp.sum(jnp.sin(x @ (p["w"] * s)))  # noqa: E731
    modes = []

    def each(p, x, s):
        s = s * (lax.axis_index("models") + 1.0)  # (the model's index, outside its loss)
        modes.append(optclip.ghost_report(scaled(s), p, x)["['w']"].mode)
        return optclip.clipped_grad(scaled(s), l2_clip_norm=1.0, return_grad_norms=True)(p, x)

    multipliers = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    mapped = jax.vmap(each, axis_name="models")
    grads, aux = run(mapped, mode)(params, x, multipliers)
    assert set(modes) == {"ghost"}
    for m in range(3):
        own = {"w": params["w"][m]}
        norms, sums = gm.reference(scaled(float(multipliers[m]) * (m + 1)), own, x[m], 1.0)
        np.testing.assert_allclose(np.asarray(aux.grad_norms[m]), norms, rtol=RTOL)
        assert_tree_close({"w": grads["w"][m]}, sums)


@pytest.mark.parametrize("nan_safe", [True, False])
@pytest.mark.parametrize("number", ["w * inf", "w * nan", "w / 0"])
def test_a_traced_scale_not_finite_gives_what_the_materialising_way_gives(number, nan_safe):
    """A traced number that is not finite (known only when the step runs) gives every example
    a NaN norm, as the materialising way's infinity-times-zero entries do: the batch is
    dropped (its sums 0) with `nan_safe`, its sums NaN without (those of the unused leaf `u`
    too: ``sum_b w_b 0``, it gave 0): the same bits as ``method="vmap"``."""
    value = {"w * inf": np.inf, "w * nan": np.nan}.get(number, 0.0)
    scale = (lambda w, s: w / s) if number == "w / 0" else (lambda w, s: w * s)
    make = lambda s: lambda p, x: jnp.sum(jnp.sin(x @ scale(p["w"], s)))  # noqa: E731
    params = {"w": jnp.ones((3, 2)), "u": jnp.ones((3,))}
    x = jnp.ones((4, 3))
    out = {}
    for method in ("auto", "vmap"):

        def step(p, x, s, method=method):
            g = optclip.clipped_grad(
                make(s), l2_clip_norm=1.0, return_grad_norms=True, method=method, nan_safe=nan_safe
            )
            return g(p, x)

        out[method] = jax.jit(step)(params, x, jnp.float32(value))
    assert np.all(np.isnan(out["auto"][1].grad_norms))
    np.testing.assert_array_equal(out["auto"][1].grad_norms, out["vmap"][1].grad_norms)
    for leaf in ("w", "u"):
        np.testing.assert_array_equal(out["auto"][0][leaf], out["vmap"][0][leaf])


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name", ["tied", "and a written one"])
def test_the_gradient_with_respect_to_a_traced_scale(name, mode):
    """`jax.grad` with respect to the multiplier, through the clipped sums and through the
    norms (the weights held fixed, as every method holds them): the materialising way's, for
    a weight used twice scaled by it ("tied") and used scaled by it and by a written number
    (the cross term times their product)."""
    make, params, x, _, _, _ = _traced_models(np.random.default_rng(49))[name]
    probe = jnp.asarray(np.random.default_rng(50).normal(size=(6, 6)), jnp.float32)
    out = {}
    for method in ("auto", "vmap"):

        def objective(s, method=method):
            g = optclip.clipped_grad(
                make(s), l2_clip_norm=1.0, return_grad_norms=True, method=method
            )
            grads, aux = g(params, x)
            return jnp.sum(grads["w"] * probe) + jnp.sum(aux.grad_norms)

        out[method] = run(jax.value_and_grad(objective), mode)(jnp.float32(0.5))
    np.testing.assert_allclose(out["auto"][0], out["vmap"][0], rtol=1e-5)
    np.testing.assert_allclose(out["auto"][1], out["vmap"][1], rtol=1e-4)
    assert float(out["auto"][1]) != 0.0


def test_a_number_that_depends_on_where_it_runs_is_not_computed_while_tracing():
    """A scale from ``lax.axis_index`` (here the index of each of three models `jax.vmap`
    trains at once) is a scalar made from no variable, but its value is the device's or the
    model's: not computed while the loss is traced (only arithmetic is), a site, each model's
    sums and norms the float64 reference's for its own number."""
    rng = np.random.default_rng(46)
    params = {"w": jnp.asarray(rng.normal(size=(3, 6, 5)) * 0.5, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(3, 4, 2, 6)), jnp.float32)
    scaled = lambda s: lambda p, x: jnp.sum(jnp.sin(x @ (p["w"] * s)))  # noqa: E731

    def each(p, x):  # (one model's step: its weight times its index plus one, in the loss)
        loss = lambda p, x: scaled(lax.axis_index("models") + 1.0)(p, x)  # noqa: E731
        return optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)(p, x)

    grads, aux = jax.jit(jax.vmap(each, axis_name="models"))(params, x)
    for m in range(3):
        own = {"w": params["w"][m]}
        norms, sums = gm.reference(scaled(m + 1.0), own, x[m], 1.0)
        np.testing.assert_allclose(np.asarray(aux.grad_norms[m]), norms, rtol=RTOL)
        assert_tree_close({"w": grads["w"][m]}, sums)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_scaled_bfloat16_weight_stays_ghost(mode):
    """A bfloat16 weight scaled by a bfloat16 number: ghost, and within bfloat16's rounding of
    the materialising way (its pull-back through the scale in float32)."""
    rng = np.random.default_rng(44)
    params = {"w": jnp.asarray(rng.normal(size=(6, 5)) * 0.5, jnp.bfloat16)}
    x = jnp.asarray(rng.normal(size=(5, 3, 6)), jnp.bfloat16)
    loss = lambda p, x: jnp.sum(jnp.sin(x @ (p["w"] * 0.375)).astype(jnp.float32))  # noqa: E731
    assert optclip.ghost_report(loss, params, x)["['w']"].mode == "ghost"
    gm.assert_as_vmap_to_bfloat16_rounding(loss, params, x, 0.5, mode=mode)


STRICT = {  # (models written without implicit promotion, and the clip that sends each down
    # its path: the common one, the norms' scaled one, the sums' shared factor, a dropped example)
    "mlp": (gm.mlp, jnp.float32, 1.0),
    "tied": (lambda rng, dtype: gm.embedding(rng, tied=True), jnp.float32, 1.0),
    "transformer": (gm.transformer, jnp.float32, 0.5),
    "conv": (gm.conv, jnp.float32, 1.0),
    "recurrent in float16": (gm.recurrent, jnp.float16, 1e-4),
    "sequence in bfloat16": (gm.sequence, jnp.bfloat16, 1.0),
    "huge": (lambda rng, dtype: _large_inputs(3), jnp.float32, 1e-10),
}


@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name", list(STRICT))
def test_strict_dtype_promotion_gives_the_same_bits(name, mode):
    """Under ``jax_numpy_dtype_promotion="strict"`` the engine runs (its checks added Python
    floats to int32 exponents, and low-precision sums promoted implicitly: TypePromotionError)
    and gives the bits it gives under standard promotion, jitted and eager: every dtype it uses
    is named. With a non-finite example too (dropped: the sums' other path). The
    `jax.distributed` worker runs it under strict promotion as well."""
    build, dtype, clip = STRICT[name]
    loss, params, x = build(np.random.default_rng(4), dtype=dtype)
    batches = [x]
    if jnp.issubdtype(x.dtype, jnp.floating):
        batches.append(x.at[1].set(jnp.inf))
    for batch in batches:
        out = {}
        for promotion in ("standard", "strict"):  # (a step traced anew under each)
            g = optclip.clipped_grad(loss, l2_clip_norm=clip, return_grad_norms=True)
            with jax.numpy_dtype_promotion(promotion):
                out[promotion] = run(g, mode)(params, batch)
        strict, standard = out["strict"], out["standard"]
        for a, b in zip(jax.tree.leaves(strict), jax.tree.leaves(standard), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_static_python_arguments_stay_python():
    # As under `jax.vmap`: a Python flag neither differentiated nor batched stays a Python
    # value (the loss branches on it); a Python float parameter is differentiated.
    loss, params, x = gm.mlp(np.random.default_rng(9))

    def flagged(p, x, training, scale):
        return loss(p, x) * (scale if training else 0.0)

    for method in ("auto", "vmap"):
        g = optclip.clipped_grad(flagged, l2_clip_norm=1.0, method=method)
        grads = jax.jit(g, static_argnums=2)(params, x, True, 2.0)
        _, sums = gm.reference(lambda p, x: flagged(p, x, True, 2.0), params, x, 1.0)
        assert_tree_close(grads, sums)
    f = lambda w, data: 0.5 * jnp.mean((data - w) ** 2)  # noqa: E731  (jax_privacy's example)
    assert float(optclip.clipped_grad(f, l2_clip_norm=jnp.inf)(3.0, jnp.array([0, 7, -2]))) == 4
    assert optclip.ghost_report(flagged, params, x, True, 2.0)["['w1']"].mode == "ghost"


def test_a_scans_consts_and_carries_are_read_in_either_jax_layout():
    # jax 0.10 gives a `scan` its numbers of consts and carries (`num_consts`, `num_carry`);
    # jax 0.11 packs its operands' three parts (consts, carries, scanned inputs) in `ft_in`.
    # Both are read; any other layout is refused by name, never misread.
    from optclip.per_example.ghost import _jaxprs

    w = jnp.arange(3.0)

    def f(c, xs):
        return lax.scan(lambda c, x: (c * w + x, c), c, xs)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((4, 3)))
    eqn = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    assert _jaxprs.scan_counts(eqn) == (1, 1)

    class Parts:  # jax 0.11's `ft_in` (a FlatTree), as far as it is read
        def unpack(self):
            return ([None] * 2, [None] * 3, [None])

    bare = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry", "ft_in")}
    assert _jaxprs.scan_counts(eqn.replace(params={**bare, "ft_in": Parts()})) == (2, 3)

    class Unpackable:  # an `ft_in` that is not a pack (JAX asserts)
        def unpack(self):
            raise AssertionError

    class TwoParts:  # an `ft_in` of other parts than consts, carries and scanned inputs
        def unpack(self):
            return ([None], [None])

    for params in (bare, {**bare, "ft_in": Unpackable()}, {**bare, "ft_in": TwoParts()}):
        with pytest.raises(
            NotImplementedError,
            match=r"does not know the parameters of this JAX's \(.*\) `scan` "
            r"\((ft_in, )?jaxpr, length, ",
        ):
            _jaxprs.scan_counts(eqn.replace(params=params))


def test_the_private_step_keeps_the_models_source_lines():
    """The tapped pass binds the model's equations again under their own source lines, as
    `jax.grad` keeps them: a profile of the private step, or its compiled module's metadata,
    names the model's lines, not the engine's."""

    def loss(w, x):
        return jnp.sum(jnp.cos(jnp.sin(x @ w)))

    line = inspect.getsourcelines(loss)[1] + 1
    w, x = jnp.ones((3, 4)), jnp.ones((2, 5, 3))
    for step in (jax.grad(loss), optclip.clipped_grad(loss, l2_clip_norm=1.0)):
        text = jax.jit(step).lower(w, x).as_text(debug_info=True)
        located = re.findall(r'loc\("[^"]*test_ghost\.py":(\d+):', text)
        assert str(line) in located, (step, sorted(set(located)))


def test_without_jaxs_source_api_the_step_is_the_same(monkeypatch):
    """`_interpret._located` keeps the model's source lines through JAX's private
    `source_info_util`; where that is missing or differs, no line is kept and nothing else
    changes."""
    from optclip.per_example.ghost import _interpret

    loss, params, x = gm.mlp(np.random.default_rng(21))
    step = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True)
    kept = jax.jit(step)(params, x)
    for broken in (None, object()):
        monkeypatch.setattr(_interpret, "source_info_util", broken)
        step = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True)
        for a, b in zip(jax.tree.leaves(jax.jit(step)(params, x)), jax.tree.leaves(kept)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_ghost_and_materialised_sums_drop_the_same_examples(mode):
    """The ghost sites' clipped sums and the materialised leaves' (the MLP's biases) share one
    `cond` (`_sums.clipped_sums`): with every dropped example finite (padding holding data),
    both are plain weighted sums; with a dropped example of non-finite values (padding holding
    inf, or a NaN example `nan_safe` drops), both zero it first. Against float64, eager and
    jitted."""
    loss, params, x = gm.mlp(np.random.default_rng(22))
    report = str(optclip.ghost_report(loss, params, x))
    assert "['b1']  materialised" in report and "['w1']  ghost" in report, report
    padding = np.array([False, True, False, False, False, False])
    check_against_reference(loss, params, x, 0.5, mode=mode, is_padding_example=padding)
    g = run(optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True), mode)
    for bad, dropped in ((x.at[1].set(jnp.inf), padding), (x.at[3, 0].set(jnp.nan), None)):
        grads, aux = g(params, bad, is_padding_example=padding)
        dropped = padding | (np.arange(x.shape[0]) == 3) if dropped is None else dropped
        assert np.isfinite(np.asarray(aux.grad_norms)[~dropped]).all()
        _, sums = gm.reference(loss, params, x, 0.5, dropped)
        assert_tree_close(grads, sums)


PINNED = re.compile(
    r"@LayoutConstraint\(.*result_layouts = \[dense<\[([0-9, ]+)\]> : tensor<\d+xindex>\]\} "
    r": \(tensor<([0-9x]+)xf32>\)"
)


@pytest.mark.parametrize("remat", [False, True])
def test_the_output_gradients_are_held_row_major_on_every_platform(remat):
    """`_interpret.in_row_major`: lowered for a GPU or a CPU, the step holds each example's
    output gradient at each tapped site row-major (the scanned layer's ``(B, 1, T, d)`` per
    layer, the head's ``(B, 1, T)``), where XLA's GPU layout assignment laid the scanned one
    out for the bias's per-example sum and transposed the layer's residuals to match."""
    loss, params, x = gm.scanned(np.random.default_rng(23), remat=remat)
    report = str(optclip.ghost_report(loss, params, x))
    assert "['b']     materialised" in report and "['w']     ghost" in report, report

    def lowered(platform):
        step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))  # (traced anew)
        return step.trace(params, x).lower(lowering_platforms=(platform,)).as_text()

    pinned = [("2, 1, 0", "4x1x2"), ("3, 2, 1, 0", "4x1x2x4")]  # (head's, w's)
    assert sorted(PINNED.findall(lowered("cuda"))) == pinned
    assert sorted(PINNED.findall(lowered("cpu"))) == pinned


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_a_products_output_gradient_is_left_to_xla_where_its_weight_comes_first(platform):
    """`_shared.weight_first`: lowered for a CPU or a GPU, the output gradients of ``W @ x``
    under `jax.vmap` (as Equinox writes a layer), of such a product alone, and of a sum of
    two of them in a scan's step (an LSTM's ``W x + U h``) hold no layout constraint; the
    output gradient of ``x @ W`` is held row-major."""
    rng = np.random.default_rng(31)
    shapes = {"w": (5, 4), "u": (5, 5), "v": (5, 6), "s": (3, 6)}
    params = {k: jnp.asarray(rng.normal(size=n), jnp.float32) for k, n in shapes.items()}

    def loss(p, x):
        h = x[0]  # (T, 4)
        a = jax.vmap(lambda r: p["w"] @ r)(h)  # W @ x per position

        def cell(c, r):
            c = jnp.tanh(p["w"] @ r + p["u"] @ c)  # a sum of two
            return c, c

        _, cs = jax.lax.scan(cell, jnp.zeros(5), h)
        b = jnp.tanh(a + cs) @ p["v"]  # x @ W: (T, 6), held row-major
        return jnp.sum(b**2) + jnp.sum(jnp.tanh(p["s"] @ b.T))  # W @ x: (3, T)

    x = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    report = str(optclip.ghost_report(loss, params, x))
    assert report.count("ghost") == 2 * len(shapes), report
    step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))
    text = step.trace(params, x).lower(lowering_platforms=(platform,)).as_text()
    assert PINNED.findall(text) == [("2, 1, 0", "2x3x6")]


@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_a_part_of_a_transposed_products_output_is_held_row_major(mode):
    """`_shared.weight_first` leaves a ``W @ x`` output's gradient to XLA only in the
    product's own order: a part of its transpose, tapped below it (the other part's gradient
    comes from an earlier tap, an ``x @ W`` output it is added to), is held row-major. The
    norms and sums, jitted and eager, are the float64 reference's: clipped and unclipped
    examples, at magnitudes whose squares overflow, with a padding example and a NaN one."""
    rng = np.random.default_rng(32)
    shapes = {"v": (4, 3), "w": (6, 4)}
    params = {k: jnp.asarray(rng.normal(size=n), jnp.float32) for k, n in shapes.items()}

    def loss(p, x):
        h = x[0]  # (T, 4)
        a = h @ p["v"]  # x @ W: (T, 3), tapped first
        first, second = jnp.split((p["w"] @ h.T).T, 2, axis=1)  # W @ x, transposed, in parts
        return jnp.sum(jnp.tanh(a + first)) + jnp.sum(jnp.tanh(second) ** 2)

    x = jnp.asarray(rng.normal(size=(4, 5, 4)), jnp.float32)
    step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))
    text = step.trace(params, x).lower().as_text()
    assert PINNED.findall(text) == [("2, 1, 0", "4x5x3")] * 2  # (a + first's, second's)
    grads64 = gm.per_example_grads(loss, params, x)
    norms64, _ = gm.reference_from(grads64, 1.0)
    clip = float(np.median(norms64))  # (some examples clipped, some not)
    step = magnitude_step(loss, clip, mode)
    for magnitude in (1.0, 1e22):
        got = step(params, x, np.float32(magnitude))
        check_against_grads(got, grads64, clip, magnitude=magnitude)
    padding = np.array([False, True, False, False])
    got = step(params, x, np.float32(1), is_padding_example=padding)
    check_against_grads(got, grads64, clip, padding=padding)
    grads, aux = step(params, x.at[2, 0, 0].set(np.nan), np.float32(1))
    assert np.isnan(aux.grad_norms[2]) and np.isfinite(np.delete(aux.grad_norms, 2)).all()
    _, sums = gm.reference_from(grads64, clip, keep=[0, 1, 3])
    assert_tree_close(grads, sums)


@pytest.mark.slow  # (two programs of each model, compiled as users compile)
@pytest.mark.usefixtures("as_users_compile")  # (the same bits)
@pytest.mark.parametrize("name", ["scanned", "transformer"])
def test_holding_the_output_gradients_row_major_changes_no_value(name, monkeypatch):
    """The layout constraint of `_interpret.in_row_major`: the same gradients and norms
    without it, bit for bit, jitted and eager (on a rematerialised scan, and on the
    transformer's scanned blocks with their biases and scales), and so the float64
    reference's."""
    from optclip.per_example.ghost import _interpret

    make = functools.partial(gm.scanned, remat=True) if name == "scanned" else gm.transformer
    loss, params, x = make(np.random.default_rng(24))
    grads64 = gm.per_example_grads(loss, params, x)
    for mode in ("jit", "eager"):
        step = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True)
        pinned = run(step, mode)(params, x)
        check_against_grads(pinned, grads64, 0.5)
        with monkeypatch.context() as m:
            m.setattr(_interpret, "in_row_major", lambda g: g)
            step = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True)
            plain = run(step, mode)(params, x)
        for a, b in zip(jax.tree.leaves(pinned), jax.tree.leaves(plain), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_the_output_gradient_is_kept_once_not_beside_its_scaled_copy():
    # A model whose largest tensor is its output layer's gradient (16 x 64 x 2048 logits):
    # the tap gives that gradient itself and its exponent, and it is scaled after the
    # backward pass (`_interpret.scaled`). Scaled in the tap's backward, beside the gradient
    # the backward pass still reads, the step took 1.005x the non-private step's memory by
    # XLA's analysis; kept once, 0.71x.
    B, T, D, V = 16, 64, 16, 2048
    rng = np.random.default_rng(0)
    shapes = {"embed": (V, D), "w": (D, D), "out": (D, V)}
    params = {k: jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for k, s in shapes.items()}
    ids = jnp.asarray(rng.integers(0, V, size=(B, T)))

    def loss(p, i):
        logits = jnp.tanh(p["embed"][i] @ p["w"]) @ p["out"]
        return -jnp.sum(jax.nn.log_softmax(logits)[..., 0])

    summed = lambda p, i: jnp.sum(jax.vmap(loss, in_axes=(None, 0))(p, i[:, None]))  # noqa: E731
    plain = gm.compiled_peak(jax.grad(summed), params, ids)
    ghost = gm.compiled_peak(optclip.clipped_grad(loss, l2_clip_norm=1.0), params, ids)
    assert ghost <= 0.9 * plain, (ghost, plain)
