"""Tests of the adaptive transforms (agc, autoclip, zclip) against plain re-statements."""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import optclip

STEPS = 100  # length of the norm sequences (>= 80, with spikes)

_rng = np.random.default_rng(0)
_A = _rng.standard_normal((3, 4))
_B = _rng.standard_normal(5)
_SCALE = 1 / math.sqrt(np.sum(_A**2) + np.sum(_B**2))
DIRECTION = {"a": _A * _SCALE, "b": _B * _SCALE}  # global norm 1


def norm_sequence(base=1.0, seed=1, steps=STEPS):
    """Log-normal norms around `base` with spikes (x8 to x40) at fixed steps, float32-exact."""
    rng = np.random.default_rng(seed)
    norms = base * np.exp(0.15 * rng.standard_normal(steps))
    for step, factor in ((9, 8.0), (30, 20.0), (31, 15.0), (52, 40.0), (70, 10.0), (88, 25.0)):
        if step < steps:
            norms[step] *= factor
    return norms.astype(np.float32).astype(np.float64)


def tree_with_norm(norm, dtype=np.float32):
    """(NumPy arrays: building it compiles nothing.)"""
    return {k: np.asarray(v * norm, dtype) for k, v in DIRECTION.items()}


def stacked_trees(norms):
    return {k: jnp.asarray(np.multiply.outer(norms, v), jnp.float32) for k, v in DIRECTION.items()}


def run(tx, norms, how):
    """Runs `tx` over trees of the given norms: "eager", "jit" or "scan".

    Returns the per-step output trees (stacked) and states (stacked), as NumPy.
    """
    state = tx.init(tree_with_norm(1.0))
    if how == "scan":

        def body(state, grads):
            updates, state = tx.update(grads, state)
            return state, (updates, state)

        _, (updates, states) = jax.jit(lambda s, g: lax.scan(body, s, g))(
            state, stacked_trees(norms)
        )
        return jax.tree.map(np.asarray, updates), jax.tree.map(np.asarray, states)
    update = tx.update if how == "eager" else jax.jit(tx.update)
    outs, states = [], []
    for n in norms:
        updates, state = update(tree_with_norm(n), state)
        outs.append(updates)
        states.append(state)
    stack = lambda *xs: np.stack([np.asarray(x) for x in xs])  # noqa: E731
    return jax.tree.map(stack, *outs), jax.tree.map(stack, *states)


def check_scales(updates, norms, scales, rtol=2e-5):
    """Every step's output is the input tree times the expected scale."""
    expected = stacked_trees(np.asarray(norms) * np.asarray(scales))
    for key in DIRECTION:
        np.testing.assert_allclose(updates[key], expected[key], rtol=rtol, atol=1e-6)


def cases(configs, eager_every=2):
    """(config, how) pairs: every config jitted and in `lax.scan`, every other one eager too
    (eager runs the same code and costs ~10 ms a step)."""
    out = []
    for i, config in enumerate(configs):
        hows = ("jit", "scan", "eager") if i % eager_every == 0 else ("jit", "scan")
        out.extend((config, how) for how in hows)
    return out


# ----------------------------------------------------------------------------------------------
# ZClip


def zclip_reference(
    norms,
    alpha=0.97,
    z_thresh=2.5,
    max_norm=1.0,
    warmup_steps=25,
    mode="zscore",
    clip_option="adaptive_scaling",
    clip_factor=1.0,
    skip_update_on_spike=False,
    eps=1e-6,
):
    """The reference implementation's `step` on a sequence of norms, in plain Python.

    Returns per step: the scale applied, mean, var (None during warm-up) and the spike flag.
    The only change: the scale is `c / n` (the reference divides by `n + 1e-6`). A callable
    `max_norm` is a schedule of the step (optclip's extension), read at every step.
    """
    buffer, initialized, mean, var = [], False, None, None
    out = []
    schedule = max_norm if callable(max_norm) else None
    for step, n in enumerate(norms):
        if schedule is not None:
            max_norm = float(schedule(step))
        if not initialized:
            buffer.append(n)
            if len(buffer) >= warmup_steps:
                mean = sum(buffer) / len(buffer)
                var = sum((x - mean) ** 2 for x in buffer) / len(buffer)
                initialized = True
            cap = math.inf if max_norm is None else max_norm
            out.append((min(1.0, cap / n), mean, var, False))
            continue
        std = var**0.5
        clip_val = None
        if mode == "percentile":
            threshold = mean + z_thresh * std
            if n > threshold:
                clip_val = threshold
        else:
            z = (n - mean) / (std + eps)
            if z > z_thresh:
                if clip_option == "adaptive_scaling":
                    eta = z / z_thresh
                    clip_val = (mean + (z_thresh * std) / eta) * clip_factor
                else:
                    clip_val = mean
        adaptive = clip_val if clip_val is not None else n
        effective = adaptive if max_norm is None else min(adaptive, max_norm)
        scale = effective / n if n > effective else 1.0
        if not (clip_val is not None and skip_update_on_spike):
            x = clip_val if clip_val is not None else n
            mean = alpha * mean + (1 - alpha) * x
            var = alpha * var + (1 - alpha) * (x - mean) ** 2
        out.append((scale, mean, var, clip_val is not None))
    return out


ZCLIP_CONFIGS = [
    dict(),  # the reference's defaults: max_norm=1.0 caps most steps of norm ~1
    dict(max_norm=None, warmup_steps=10),
    dict(max_norm=None, warmup_steps=5, clip_option="mean"),
    dict(max_norm=1.5, warmup_steps=8, clip_factor=0.7, skip_update_on_spike=True),
    dict(max_norm=None, warmup_steps=6, mode="percentile", z_thresh=2.0, alpha=0.9),
    dict(max_norm=None, warmup_steps=5, mode="percentile", skip_update_on_spike=True),
    # A schedule for the cap: loose at first, then tight enough to cap some ordinary steps.
    dict(max_norm=optax.linear_schedule(3.0, 1.0, transition_steps=60), warmup_steps=8),
]


@pytest.mark.parametrize(
    "config,how",
    cases(ZCLIP_CONFIGS),
    ids=lambda v: (
        ",".join(f"{k}={'schedule' if callable(x) else x}" for k, x in v.items())
        if isinstance(v, dict)
        else v
    ),
)
def test_zclip_matches_reference(config, how):
    norms = norm_sequence()
    steps = len(norms)
    expected = zclip_reference(norms, **config)
    updates, states = run(optclip.zclip(**config), norms, how)
    check_scales(updates, norms, [e[0] for e in expected])
    np.testing.assert_allclose(states.global_norm, norms, rtol=1e-6)
    warmup = config.get("warmup_steps", 25)
    done = [i for i, e in enumerate(expected) if e[1] is not None]
    np.testing.assert_allclose(states.mean[done], [expected[i][1] for i in done], rtol=2e-5)
    np.testing.assert_allclose(
        states.var[done], [expected[i][2] for i in done], rtol=5e-4, atol=1e-7
    )
    spikes = np.cumsum([e[3] for e in expected])
    np.testing.assert_array_equal(states.spike_count, spikes)
    np.testing.assert_array_equal(states.finite_count, np.arange(1, steps + 1))
    if steps > warmup + 10:
        assert spikes[-1] >= 3  # the sequence does exercise the spike path


def test_zclip_threshold_field():
    """`threshold` is the cap during warm-up, then the spike boundary from the prior statistics."""
    norms = norm_sequence()
    _, states = run(optclip.zclip(warmup_steps=5, max_norm=3.0), norms, "jit")
    np.testing.assert_array_equal(states.threshold[:5], 3.0)
    std = np.sqrt(states.var[4:-1].astype(np.float64))
    boundary = np.minimum(states.mean[4:-1] + 2.5 * (std + 1e-6), 3.0)
    np.testing.assert_allclose(states.threshold[5:], boundary, rtol=1e-5)
    # A norm above the threshold was scaled down; one at or below it passed unchanged.
    assert np.all(
        (norms[5:] > states.threshold[5:]) | (states.spike_count[5:] == states.spike_count[4:-1])
    )


def test_zclip_nonfinite_changes_no_statistic():
    norms = list(norm_sequence(steps=40))
    bad = {3: np.nan, 20: np.inf}
    with_bad = [bad.get(i, n) for i, n in enumerate(norms)]
    for nonfinite in ("propagate", "zero"):
        tx = optclip.zclip(warmup_steps=5, max_norm=None, nonfinite=nonfinite)
        updates, states = run(tx, with_bad, "jit")
        _, clean_states = run(tx, [n for i, n in enumerate(norms) if i not in bad], "jit")
        keep = [i for i in range(len(norms)) if i not in bad]
        for field in ("mean", "var", "finite_count", "spike_count"):
            np.testing.assert_array_equal(
                getattr(states, field)[keep], getattr(clean_states, field)
            )
        np.testing.assert_array_equal(states.nonfinite_count[-1], 2)
        for i in bad:
            assert np.array_equal(states.mean[i], states.mean[i - 1])
            if nonfinite == "zero":
                assert not np.any(updates["a"][i])
            else:
                assert np.all(np.isnan(updates["a"][i]))


# ----------------------------------------------------------------------------------------------
# AutoClip


def autoclip_reference(norms, percentile, history):
    window = collections.deque(maxlen=history)
    out = []
    for n in norms:
        window.append(n)
        threshold = float(np.percentile(np.asarray(window), percentile))
        out.append((min(1.0, threshold / n), threshold))
    return out


AUTOCLIP_CONFIGS = [(10.0, 1000), (50.0, 16), (97.5, 7), (0.0, 5), (100.0, 1), (33.3, 25)]


@pytest.mark.parametrize("config,how", cases(AUTOCLIP_CONFIGS))
def test_autoclip_matches_reference(config, how):
    percentile, history = config
    norms = norm_sequence(seed=2)
    steps = len(norms)
    expected = autoclip_reference(norms, percentile, history)
    updates, states = run(optclip.autoclip(percentile, history), norms, how)
    check_scales(updates, norms, [e[0] for e in expected])
    np.testing.assert_allclose(states.threshold, [e[1] for e in expected], rtol=1e-5)
    np.testing.assert_allclose(states.global_norm, norms, rtol=1e-6)
    np.testing.assert_array_equal(states.filled, np.minimum(np.arange(1, steps + 1), history))
    assert states.norms.shape == (steps, history)
    clipped = np.cumsum([norms[i] > e[1] * (1 + 1e-6) for i, e in enumerate(expected)])
    np.testing.assert_array_equal(states.clip_count, clipped)


def test_autoclip_first_step_and_defaults():
    tx = optclip.autoclip()
    state = tx.init(tree_with_norm(1.0))
    assert state.norms.shape == (1000,) and state.threshold == np.inf
    updates, state = tx.update(tree_with_norm(7.0), state)  # the only norm is its own percentile
    np.testing.assert_array_equal(updates["a"], tree_with_norm(7.0)["a"])
    np.testing.assert_allclose(state.threshold, 7.0, rtol=1e-6)


def test_autoclip_nonfinite_does_not_poison_history():
    norms = list(norm_sequence(seed=3, steps=30))
    bad = {0: np.nan, 12: np.inf, 13: np.nan}
    with_bad = [bad.get(i, n) for i, n in enumerate(norms)]
    clean = [n for i, n in enumerate(norms) if i not in bad]
    expected = autoclip_reference(clean, 25.0, 8)
    for nonfinite in ("propagate", "zero"):
        updates, states = run(optclip.autoclip(25.0, 8, nonfinite=nonfinite), with_bad, "jit")
        keep = [i for i in range(len(norms)) if i not in bad]
        np.testing.assert_allclose(states.threshold[keep], [e[1] for e in expected], rtol=1e-5)
        assert states.threshold[0] == np.inf  # nothing recorded yet
        np.testing.assert_array_equal(states.nonfinite_count[-1], 3)
        assert np.all(np.isfinite(states.norms))
        for i in bad:
            assert (
                (not np.any(updates["b"][i]))
                if nonfinite == "zero"
                else np.all(np.isnan(updates["b"][i]))
            )


# ----------------------------------------------------------------------------------------------
# AGC


def agc_tree(seed, grad_scale):
    rng = np.random.default_rng(seed)
    shapes = {
        "conv": (3, 3, 4, 8),  # HWIO
        "conv3d": (2, 2, 2, 3, 4),  # DHWIO
        "dense": (16, 8),
        "multihead": (6, 2, 4),
        "bias": (8,),
        "row": (1, 5),  # one unit in optax's rule (squeezes to a vector)
        "scalar": (),
    }
    # (NumPy arrays: building them compiles nothing)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params["zero_bias"] = np.zeros(4, np.float32)  # eps floor
    grads = {
        k: np.asarray(grad_scale * rng.standard_normal(np.shape(v)) * rng.uniform(0, 2), np.float32)
        for k, v in params.items()
    }
    return grads, params


AGC_CONFIGS = [(0.01, 1e-3, 0.01), (0.05, 0.1, 0.05), (1.0, 1e-3, 0.3)]


@jax.jit
def _agc_jitted(grads, params, clipping, eps):  # one compile for every configuration
    """optclip's AGC (updates and state) and optax's (updates), in one program."""
    tx, theirs = optclip.agc(clipping, eps), optax.adaptive_grad_clip(clipping, eps)
    got, state = tx.update(grads, tx.init(params), params)
    want, _ = theirs.update(grads, theirs.init(params), params)
    return got, state, want


def _norm64(tree):
    """The global norm of a tree, in float64 NumPy (compiles nothing)."""
    return math.sqrt(sum(np.sum(np.square(np.float64(x))) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("clipping,eps,grad_scale", AGC_CONFIGS)
@pytest.mark.parametrize("jit", [True, False])  # (the fast tier runs the first case: jitted)
def test_agc_matches_optax(clipping, eps, grad_scale, jit):
    grads, params = agc_tree(int(clipping * 100), grad_scale)
    got, state, want = _agc_jitted(grads, params, clipping, eps)
    if not jit:
        ours = optclip.agc(clipping, eps)
        got, state = ours.update(grads, ours.init(params), params)
    for key in grads:
        np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-9, err_msg=key)
    for key in grads:  # a leaf optax leaves alone is unchanged bit for bit
        assert np.array_equal(got[key], grads[key]) == np.array_equal(want[key], grads[key])
    assert any(not np.array_equal(got[k], grads[k]) for k in grads)
    np.testing.assert_allclose(state.global_norm, _norm64(grads), rtol=1e-6)
    assert _norm64(got) <= float(state.threshold) * (1 + 1e-6)


@pytest.mark.slow  # an option and an edge case of AGC (eager: ~8 s)
def test_agc_axis_and_tiny_threshold():
    grads, params = agc_tree(5, 0.1)
    # `axis` applies to every leaf: only leaves with 2 or more dimensions here.
    g = {k: v for k, v in grads.items() if v.ndim >= 2}
    p = {k: v for k, v in params.items() if v.ndim >= 2}
    for axis in (0, (0, -1)):
        got, _ = jax.jit(optclip.agc(0.02, axis=axis).update)(g, optclip.agc().init(p), p)
        tx = optax.adaptive_grad_clip(0.02, axis=axis)
        want, _ = tx.update(g, tx.init(p), p)
        for key in g:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-6, atol=1e-9)
    # Where clipping * max(|W|, eps) < 1e-6, the unit's norm is exactly the limit (optax's
    # max(norm, 1e-6) divisor clips below it): a documented difference.
    w, g = jnp.array([1e-7, 0.0]), jnp.array([3e-7, 4e-7])
    out, _ = optclip.agc(0.5, eps=1e-9).update(g, optclip.agc().init(w), w)
    np.testing.assert_allclose(np.linalg.norm(out), 5e-8, rtol=1e-5)


def test_agc_errors():
    grads, params = agc_tree(0, 0.1)
    tx = optclip.agc()
    state = tx.init(params)  # (one state for every call: `init` is pure)
    with pytest.raises(ValueError, match=r"`agc` .*`params=None`"):
        tx.update(grads, state)
    with pytest.raises(ValueError, match="same structure"):
        tx.update(grads, state, {"dense": params["dense"]})
    # (From "dense" on, in the leaves' order: the leaves before it would each run eagerly
    # first, ~60 small compiles, before the error.)
    g = {k: v for k, v in grads.items() if k >= "dense"}
    p = {k: v for k, v in params.items() if k >= "dense"}
    with pytest.raises(ValueError, match=r"leaf `\['dense'\]` has update shape \(16, 8\)"):
        tx.update(g, state, {**p, "dense": p["dense"].T})
    with pytest.raises(TypeError, match=r"leaf `\['i'\]` has dtype int32"):
        tx.update({"i": np.ones(3, np.int32)}, state, {"i": np.ones(3, np.int32)})
    with pytest.raises(ValueError, match=r"`clipping` must be a number >= 0, got -0.1"):
        optclip.agc(-0.1)
    with pytest.raises(ValueError, match=r"`eps` must be a number >= 0, got nan"):
        optclip.agc(eps=float("nan"))
    with pytest.raises(ValueError, match=r"`clipping` must be a scalar, got an array of shape"):
        optclip.agc(jnp.ones(2))
    with pytest.raises(TypeError, match="`axis` must be None, an int"):
        optclip.agc(axis="rows")
    with pytest.raises(ValueError, match=r"`axis` \(2,\) is out of range for leaf `\['bias'\]`"):
        optclip.agc(axis=2).update(grads, state, params)


@pytest.mark.slow  # the same splits run under a real shard_map in the 8-device worker
def test_agc_axis_name_splits_units():
    """Inside a mapped axis (vmap stands in for shard_map), split units get their whole norm."""
    rng = np.random.default_rng(7)
    shapes = {"rows": (8, 6), "cols": (8, 8), "thin": (4, 6), "bias": (8,), "plain": (8, 3)}
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    grads = {k: 0.05 * jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    tx = optclip.agc(0.02)
    want, want_state = tx.update(grads, tx.init(params), params)
    # How each leaf is split over the 4 devices of axis "x": "plain" by name (its unit
    # dimension), the others by PartitionSpec; "cols" along its kept (output) dimension.
    split_dim = {"rows": 0, "cols": 1, "thin": 0, "bias": 0, "plain": 0}
    specs = {
        "rows": P("x", None),
        "cols": P(None, "x"),
        "thin": P("x"),
        "bias": P("x"),
        "plain": "x",
    }

    def shard(tree):
        return {k: jnp.stack(jnp.split(v, 4, axis=split_dim[k])) for k, v in tree.items()}

    def unshard(tree):
        return {k: jnp.concatenate(list(v), axis=split_dim[k]) for k, v in tree.items()}

    split_tx = optclip.agc(0.02, axis_name=specs)

    def step(g, p):
        return split_tx.update(g, split_tx.init(p), p)

    got, state = jax.jit(jax.vmap(step, axis_name="x"))(shard(grads), shard(params))
    for key in grads:
        np.testing.assert_allclose(unshard(got)[key], want[key], rtol=2e-6, err_msg=key)
    np.testing.assert_allclose(state.global_norm, want_state.global_norm, rtol=1e-6)
    np.testing.assert_allclose(state.threshold, want_state.threshold, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# All three: state, tracing, dtypes, gradients, inject_hyperparams, errors


def adaptive_transforms():
    return {
        "agc": optclip.agc(0.01),
        "autoclip": optclip.autoclip(20.0, history=9),
        "zclip": optclip.zclip(warmup_steps=4, max_norm=None),
    }


@pytest.mark.parametrize("name", ["agc", "autoclip", "zclip"])
def test_state_fixed_and_traces_once(name):
    tx = adaptive_transforms()[name]
    params = tree_with_norm(1.0)
    traces = []

    def step(grads, state):
        traces.append(None)
        return tx.update(grads, state, params)

    step = jax.jit(step)
    state = tx.init(params)
    layout = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for n in norm_sequence(seed=4, steps=30):
        _, state = step(tree_with_norm(n * 0.01), state)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == layout
    assert len(traces) == 1
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    np.testing.assert_allclose(optax.tree.get(state, "global_norm"), n * 0.01, rtol=1e-5)
    assert np.shape(optax.tree.get(state, "threshold")) == ()


@pytest.mark.parametrize("name", ["agc", "autoclip", "zclip"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_dtypes_kept(name, dtype, mode):
    tx = adaptive_transforms()[name]
    params = tree_with_norm(1.0, dtype)
    update = jax.jit(tx.update) if mode == "jit" else tx.update
    state = tx.init(params)
    ref_tx = adaptive_transforms()[name]
    ref_params = tree_with_norm(1.0)
    ref_state = ref_tx.init(ref_params)
    ref_update = jax.jit(ref_tx.update)  # (the float32 reference: one compile, not ~30 eager)
    for n in (0.5, 0.6, 0.55, 0.5, 5.0):
        grads = tree_with_norm(n, dtype)
        out, state = update(grads, state, params)
        ref, ref_state = ref_update(
            jax.tree.map(lambda x: x.astype(jnp.float32), grads),
            ref_state,
            jax.tree.map(lambda x: x.astype(jnp.float32), params),
        )
        for key in out:
            assert out[key].dtype == dtype
            np.testing.assert_allclose(np.float32(out[key]), ref[key], rtol=1e-2, atol=1e-3)
        assert state.global_norm.dtype == jnp.float32


@pytest.mark.parametrize("name", ["agc", "autoclip", "zclip"])
def test_gradient_finite_at_zero(name):
    tx = adaptive_transforms()[name]
    params = tree_with_norm(1.0)
    state = tx.init(params)
    update = jax.jit(tx.update)  # (the state to differentiate at: one compile, not ~40 eager)
    for n in (1.0, 2.0, 1.5, 1.2, 9.0):  # past zclip's warm-up, a spike last
        _, state = update(tree_with_norm(n), state, params)

    def loss(grads):
        out, _ = tx.update(grads, state, params)
        return sum(jnp.sum(x) for x in jax.tree.leaves(out))

    grad_fn = jax.jit(jax.grad(loss))
    for n in (0.0, 9.0):
        grad = grad_fn(tree_with_norm(n))
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(grad))
    for x in jax.tree.leaves(grad_fn(tree_with_norm(0.0))):
        np.testing.assert_allclose(x, 1.0)  # identity at zero input


@pytest.mark.slow  # inject_hyperparams is covered in the fast tier by global_clip's tests
def test_in_a_chain_with_inject_hyperparams():
    norms = norm_sequence(seed=5, steps=40)
    params = tree_with_norm(1.0)
    cases = [
        (
            optax.inject_hyperparams(optclip.zclip)(
                alpha=0.9, z_thresh=2.0, max_norm=None, warmup_steps=5
            ),
            optclip.zclip(alpha=0.9, z_thresh=2.0, max_norm=None, warmup_steps=5),
        ),
        (
            optax.inject_hyperparams(optclip.autoclip, static_args=("history",))(30.0, 10),
            optclip.autoclip(30.0, 10),
        ),
        (optax.inject_hyperparams(optclip.agc)(clipping=0.05), optclip.agc(0.05)),
    ]
    for injected, plain in cases:
        opt, ref = optax.chain(injected, optax.sgd(1.0)), optax.chain(plain, optax.sgd(1.0))
        traces = []

        def step(grads, state, opt=opt, traces=traces):
            traces.append(None)
            return opt.update(grads, state, params)

        step, ref_step = jax.jit(step), jax.jit(ref.update)
        state, ref_state = opt.init(params), ref.init(params)
        for n in norms:
            grads = tree_with_norm(n * 0.05)
            out, state = step(grads, state)
            want, ref_state = ref_step(grads, ref_state, params)
            for key in out:
                np.testing.assert_allclose(out[key], want[key], rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(
            optax.tree.get(state, "threshold"), optax.tree.get(ref_state, "threshold"), rtol=1e-5
        )
        # A new hyperparameter value: no retrace.
        hyper = state[0].hyperparams
        name = next(iter(hyper))
        state[0].hyperparams[name] = hyper[name] * 0.5
        step(tree_with_norm(1.0), state)
        assert len(traces) == 1
    with pytest.raises(TypeError, match=r"static_args=\('history',\)"):
        optax.inject_hyperparams(optclip.autoclip)(30.0, 10).init(params)


@pytest.mark.parametrize(
    "make,error,match",
    [
        (
            lambda: optclip.autoclip(percentile=-1),
            ValueError,
            r"`percentile` must be a number in \[0, 100\], got -1",
        ),
        (lambda: optclip.autoclip(percentile=100.5), ValueError, "`percentile` must be"),
        (lambda: optclip.autoclip(percentile=float("nan")), ValueError, "`percentile` must be"),
        (
            lambda: optclip.autoclip(percentile=np.ones(2)),
            ValueError,
            r"`percentile` must be a scalar, got an array of shape \(2,\)",
        ),
        (lambda: optclip.autoclip(history=0), ValueError, "`history` must be an int >= 1, got 0"),
        (lambda: optclip.autoclip(history=2.5), ValueError, "`history` must be an int >= 1"),
        (lambda: optclip.autoclip(history=True), ValueError, "`history` must be an int >= 1"),
        (lambda: optclip.autoclip(history=jnp.int32(5)), TypeError, "static_args"),
        (
            lambda: optclip.autoclip(nonfinite="skip"),
            ValueError,
            "`nonfinite` must be one of 'propagate', 'zero', 'raise'; got 'skip'",
        ),
        (lambda: optclip.zclip(alpha=1.0), ValueError, r"`alpha` must be a number in \(0, 1\)"),
        (lambda: optclip.zclip(alpha=0), ValueError, "`alpha` must be"),
        (lambda: optclip.zclip(z_thresh=0.0), ValueError, "`z_thresh` must be a number > 0"),
        (
            lambda: optclip.zclip(warmup_steps=0),
            ValueError,
            "`warmup_steps` must be an int >= 1, got 0",
        ),
        (
            lambda: optclip.zclip(mode="ema"),
            ValueError,
            "`mode` must be one of 'zscore', 'percentile'; got 'ema'",
        ),
        (
            lambda: optclip.zclip(clip_option="median"),
            ValueError,
            "`clip_option` must be one of 'adaptive_scaling', 'mean'; got 'median'",
        ),
        (lambda: optclip.zclip(clip_factor=-1.0), ValueError, "`clip_factor` must be a number > 0"),
        (
            lambda: optclip.zclip(skip_update_on_spike="yes"),
            TypeError,
            "`skip_update_on_spike` must be a Python bool, got str",
        ),
        (lambda: optclip.zclip(eps=0.0), ValueError, "`eps` must be a number > 0"),
        (
            lambda: optclip.zclip(max_norm=jnp.ones(3)),
            ValueError,
            r"`max_norm` must be a scalar, got an array of shape \(3,\)",
        ),
        (lambda: optclip.zclip(max_norm="1"), TypeError, "`max_norm` must be a real number"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_zclip_percentile_ignores_clip_option():
    optclip.zclip(mode="percentile", clip_option="anything")  # as in the reference


def test_norms_reach_float32_overflow():
    """Norms whose squares overflow float32 still give finite thresholds."""
    big = tree_with_norm(1e25)
    for name, tx in adaptive_transforms().items():
        params = tree_with_norm(1e25) if name == "agc" else tree_with_norm(1.0)
        out, state = tx.update(big, tx.init(params), params)
        np.testing.assert_allclose(state.global_norm, 1e25, rtol=1e-5)
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))
