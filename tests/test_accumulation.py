"""Gradient accumulation with a dynamic loss scale: `guarded(..., accumulation_steps=k)`.

The fault it exists for: an overflow in the middle of a window. `optax.MultiSteps` around a
loss-scaled `guarded` never recovers from one (its accumulator restarts as `0 * inf = NaN`);
`guarded` skips that window once, backs the scale off once, and trains on. Checked step by step
against a float64 NumPy re-statement of the rule (GradScaler's: a window holding an overflow
is skipped whole)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from flax import nnx

import optclip

PARAMS = {"b": jnp.zeros(3), "w": jnp.zeros((2, 3))}
RULE = dict(init_scale=64.0, growth_interval=2, min_scale=0.0)


def micro_batches(n, seed=0):
    """Unscaled gradients of `n` micro-batches, a few orders of magnitude apart."""
    return reference.gradient_steps(PARAMS, n, seed)


def planted(grads, scale, bad):
    """The gradients of the loss times `scale`; an overflow (inf or NaN) if `bad`."""
    scaled = {k: np.float32(scale) * g for k, g in grads.items()}
    if bad:
        scaled["w"] = scaled["w"].copy()
        scaled["w"][0, 1] = np.inf if bad == "inf" else np.nan
    return scaled


def numpy_restatement(grads, bad, k, lr, max_norm, init_scale, growth_interval, min_scale):
    """Each micro-step's updates and the state after it, in float64: the window's scaled
    gradients summed; on its k-th micro-batch, a finite sum is unscaled, averaged, clipped to
    `max_norm` and given to Adam, and the scale grows after `growth_interval` finite windows; a
    window holding an overflow is skipped (zeros; Adam untouched) and halves the scale."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    scale, tracker, t = init_scale, 0, 0
    m = {n: np.zeros(g.shape) for n, g in grads[0].items()}
    v = {n: np.zeros(g.shape) for n, g in grads[0].items()}
    total = {n: np.zeros(g.shape) for n, g in grads[0].items()}
    out = []
    for i, g in enumerate(grads):
        scaled = planted(g, scale, bad[i])
        total = {n: total[n] + scaled[n].astype(np.float64) for n in total}
        update = {n: np.zeros(x.shape) for n, x in total.items()}
        skipped = None
        if i % k == k - 1:
            mean = {n: x / k / scale for n, x in total.items()}
            norm = np.sqrt(sum(np.sum(x**2) for x in mean.values()))
            skipped = not np.isfinite(norm)
            if skipped:
                scale, tracker = max(scale * 0.5, min_scale), 0
            else:
                c = min(1.0, max_norm / norm)
                t += 1
                for n, x in mean.items():
                    m[n] = b1 * m[n] + (1 - b1) * c * x
                    v[n] = b2 * v[n] + (1 - b2) * (c * x) ** 2
                    m_hat, v_hat = m[n] / (1 - b1**t), v[n] / (1 - b2**t)
                    update[n] = -lr * m_hat / (np.sqrt(v_hat) + eps)
                tracker += 1
                if tracker >= growth_interval:
                    scale, tracker = scale * 2.0, 0
            total = {n: np.zeros(x.shape) for n, x in total.items()}
        out.append((update, scale, skipped))
    return out


@pytest.mark.parametrize(
    "k, bad",
    [
        # micro-batch 5 overflows: the middle of the third window (the pattern)
        (2, {5: "inf"}),
        # a NaN first in a window, two overflows in one window, one last in a window
        (3, {3: "nan", 7: "inf", 8: "inf", 14: "inf"}),
    ],
)
@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_windows_equal_numpy_restatement_step_by_step(k, bad, mode):
    n = 6 * k
    bad = [bad.get(i) for i in range(n)]
    grads = micro_batches(n)
    opt = optclip.guarded(
        optax.adam(0.1),
        clip=optclip.global_clip(3.0),
        loss_scale=optclip.DynamicLossScale(**RULE),
        accumulation_steps=k,
    )
    expected = numpy_restatement(grads, bad, k, 0.1, 3.0, **RULE)
    state = opt.init(PARAMS)
    step = jax.jit(opt.update) if mode == "jit" else opt.update
    windows_skipped = 0
    for i, g in enumerate(grads):
        scaled = planted(g, float(optclip.loss_scale(state)), bad[i])
        updates, state = step(scaled, state, PARAMS)
        want, want_scale, want_skipped = expected[i]
        for name in PARAMS:
            np.testing.assert_allclose(updates[name], want[name], rtol=2e-5, atol=1e-7)
        assert float(optclip.loss_scale(state)) == want_scale, i
        assert int(state.accumulation.micro_step) == (i + 1) % k
        if want_skipped is not None:
            windows_skipped += want_skipped
            assert bool(state.skipped) == want_skipped, i
            assert int(state.skip_count) == windows_skipped
            assert int(state.step) == (i + 1) // k  # counts windows
    # after the last overflow the windows trained: nothing stayed NaN
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.accumulation.grads))
    assert int(state.nonfinite_streak) == 0
    assert int(state.scaler.overflow_count) == windows_skipped


def test_later_windows_train_as_if_the_overflowing_window_never_happened():
    """The scale changes only by powers of two, so the unscaled gradients are bit for bit the
    same; a skipped window leaves Adam's state exactly as it was."""
    grads = micro_batches(8, seed=3)
    opt = optclip.guarded(
        optax.adam(0.1),
        clip=optclip.global_clip(1.0),
        loss_scale=optclip.DynamicLossScale(2.0**6, growth_interval=100),
        accumulation_steps=2,
    )
    step = jax.jit(opt.update)

    def train(batches):
        params, state = PARAMS, opt.init(PARAMS)
        for g, bad in batches:
            scaled = planted(g, float(optclip.loss_scale(state)), bad)
            updates, state = step(scaled, state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    with_overflow = [(g, "inf" if i == 3 else None) for i, g in enumerate(grads)]
    without = [(g, None) for i, g in enumerate(grads) if i not in (2, 3)]
    params, state = train(with_overflow)
    clean_params, clean_state = train(without)
    for name in PARAMS:
        np.testing.assert_array_equal(params[name], clean_params[name])
    assert float(optclip.loss_scale(state)) == 2.0**5  # backed off once, in window 2
    assert int(state.skip_count) == 1 and int(clean_state.skip_count) == 0


def test_multisteps_around_a_loss_scaled_guard_is_named_and_seen():
    """The nesting that cannot work: `loss_scale` raises with the cause, and the stuck state
    shows in `metrics` as a growing `nonfinite_streak` (every window non-finite)."""
    guard = optclip.guarded(
        optax.adam(1e-2),
        clip=optclip.global_clip(3.0),
        loss_scale=optclip.DynamicLossScale(init_scale=64, growth_interval=2, min_scale=0),
    )
    opt = optax.MultiSteps(guard, every_k_schedule=2)
    state = opt.init(PARAMS)
    with pytest.raises(ValueError, match=r"inside `optax\.MultiSteps`.*0 \* inf is NaN"):
        optclip.loss_scale(state)
    scaler = lambda s: s.inner_opt_state.scaler.loss_scale  # noqa: E731
    grads = micro_batches(12)
    step = jax.jit(opt.update)  # (one jitted function: traced once, not at every micro-batch)
    for i, g in enumerate(grads):
        _, state = step(planted(g, float(scaler(state)), i == 5 and "inf"), state)
    metrics = optclip.metrics(state)
    assert int(metrics["guarded/nonfinite_streak"]) == 4  # windows 3..6 all NaN after micro 5
    assert float(metrics["loss_scale/loss_scale"]) == 128.0 / 2**4  # grew once, then halved 4x


def test_metrics_show_the_window():
    opt = optclip.guarded(optax.sgd(0.1), loss_scale=True, accumulation_steps=3)
    state = opt.init(PARAMS)
    for g in micro_batches(2):
        _, state = opt.update(planted(g, 2.0**16, None), state)
    metrics = optclip.metrics(state)
    assert int(metrics["guarded/micro_step"]) == 2 and int(metrics["guarded/step"]) == 0
    assert int(metrics["guarded/nonfinite_streak"]) == 0
    assert "guarded/micro_step" not in optclip.metrics(optclip.guarded(optax.sgd(0.1)).init(PARAMS))


def test_clip_acts_on_the_mean_and_spikes_judge_windows():
    """Without a loss scale: the update is the clip of the window's mean gradient; the loss
    given as `value=` reaches the spike test (and the optimizer) as the window's mean."""
    grads = micro_batches(4, seed=5)
    grads = grads + grads[:2]  # the third window's gradients are the first's: no norm spike
    opt = optclip.guarded(
        optax.sgd(1.0),
        clip=optclip.norm_clip(0.5),
        skip_spikes=optclip.SpikeSkip(window=4, k=3.0, min_history=2),
        accumulation_steps=2,
    )
    state = opt.init(PARAMS)
    losses = [1.0, 3.0, 2.0, 4.0, 1e6, 1e6]  # window means 2 and 3, then a spike
    outs = []
    for g, loss in zip(grads, losses):
        updates, state = opt.update(g, state, PARAMS, value=jnp.float32(loss))
        outs.append(updates)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, grads[0], grads[1])
    want = optclip.clip_by_norm(mean, 0.5)
    for name in PARAMS:
        np.testing.assert_allclose(outs[1][name], -want[name], rtol=1e-6)
        np.testing.assert_array_equal(outs[0][name], 0.0)
        np.testing.assert_array_equal(outs[5][name], 0.0)  # the spike's window: skipped
    np.testing.assert_array_equal(state.spikes.losses[:2], [2.0, 3.0])  # windows' mean losses
    assert bool(state.skipped) and int(state.spikes.spike_count) == 1


def test_float16_gradients_summed_in_float32_keep_their_dtype():
    params = {"w": jnp.zeros(4, jnp.float16)}
    opt = optclip.guarded(optax.sgd(1.0), loss_scale=True, accumulation_steps=2)
    state = opt.init(params)
    assert state.accumulation.grads["w"].dtype == jnp.float32
    g = {"w": jnp.full(4, 40000.0, jnp.float16)}  # the sum of two overflows float16
    _, state = opt.update(g, state, params)
    updates, state = opt.update(g, state, params)
    assert updates["w"].dtype == jnp.float16 and not bool(state.skipped)
    np.testing.assert_allclose(updates["w"], -40000.0 / 2.0**16, rtol=1e-3)


def test_scan_equals_python_loop_and_state_keeps_its_structure():
    opt = optclip.guarded(
        optax.adam(0.05),
        clip=optclip.global_clip(1.0),
        loss_scale=optclip.DynamicLossScale(2.0**4, growth_interval=2),
        accumulation_steps=3,
    )
    data = np.random.default_rng(0).standard_normal((12, 3)).astype(np.float32)
    data[4, 0] = np.inf  # (NumPy: building it compiles nothing)

    def step(carry, x):
        params, state = carry
        scale = optclip.loss_scale(state)
        loss = lambda p: (jnp.sum((p["w"] @ x - 1.0) ** 2) + jnp.sum(p["b"] ** 2)) * scale  # noqa: E731
        grads = jax.grad(loss)(params)
        updates, new_state = opt.update(grads, state, params)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        return (optax.apply_updates(params, updates), new_state), new_state.skipped

    params = {"b": jnp.ones(3), "w": jnp.ones((2, 3))}
    (scanned, scan_state), _ = jax.lax.scan(step, (params, opt.init(params)), data)
    carry = (params, opt.init(params))
    for x in data:
        carry, _ = jax.jit(step)(carry, x)
    for a, b in zip(jax.tree.leaves((scanned, scan_state)), jax.tree.leaves(carry)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(scan_state.skip_count) == 1 and int(scan_state.step) == 4


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # (jax's event, one a program)


def test_eager_accumulation_compiles_once():
    """Eager micro-batches run the accumulation's `cond` compiled by the first window: after
    it, windows with new values (a loss scale that grows, an overflow, another loss) compile
    nothing. (Branches made anew each call, closing over its values, were traced and the whole
    step compiled again at every micro-batch.)"""
    opt = optclip.guarded(
        optax.adam(0.1),
        clip=optclip.global_clip(1.0),
        loss_scale=optclip.DynamicLossScale(**RULE),
        skip_spikes=optclip.SpikeSkip(window=4, min_history=2),
        accumulation_steps=2,
    )
    state = opt.init(PARAMS)
    compiles: list[str] = []

    def count(event, duration, **kwargs):
        if event == BACKEND_COMPILE:
            compiles.append(event)

    per_call = []
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        for i, g in enumerate(micro_batches(8)):
            before = len(compiles)
            scaled = planted(g, float(optclip.loss_scale(state)), "inf" if i == 5 else None)
            _, state = opt.update(scaled, state, PARAMS, value=jnp.float32(1.0 + i))
            per_call.append(len(compiles) - before)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert per_call[0] > 0, per_call  # (the listener sees the first call's compiles)
    assert per_call[2:] == [0] * 6, per_call  # windows 2 to 4: nothing compiled
    assert int(state.step) == 4 and int(state.skip_count) == 1  # window 3 overflowed
    assert float(optclip.loss_scale(state)) == RULE["init_scale"]  # grew in window 2, halved in 3


def test_flax_nnx_optimizer_accumulates():
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = optclip.guarded(
        optax.sgd(0.1), clip=optclip.global_clip(1.0), loss_scale=True, accumulation_steps=2
    )
    optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        scale = optclip.loss_scale(optimizer.opt_state)
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2) * scale)(model)
        optimizer.update(model, grads)

    kernel = model.kernel.get_value().copy()
    step(model, optimizer, jnp.ones((4, 3)))
    np.testing.assert_array_equal(model.kernel.get_value(), kernel)  # mid-window: unchanged
    step(model, optimizer, jnp.ones((4, 3)))
    assert not np.array_equal(model.kernel.get_value(), kernel)
    assert int(optclip.metrics(optimizer.opt_state)["guarded/micro_step"]) == 0


@pytest.mark.parametrize(
    "steps, error, match",
    [
        (0, ValueError, r"`accumulation_steps` must be an int >= 1, got 0"),
        (2.0, ValueError, r"`accumulation_steps` must be an int >= 1, got 2\.0"),
        (True, ValueError, r"`accumulation_steps` must be an int >= 1, got True"),
        (jnp.asarray(2), TypeError, r"`accumulation_steps` sets the shape of the state"),
    ],
)
def test_accumulation_steps_is_checked(steps, error, match):
    with pytest.raises(error, match=match):
        optclip.guarded(optax.sgd(0.1), accumulation_steps=steps)


def test_one_step_is_no_accumulation():
    state = optclip.guarded(optax.sgd(0.1), accumulation_steps=1).init(PARAMS)
    assert state.accumulation is None


def outcome(opt, bad=5, n=12):
    """Each micro-step's update ("0", "u" or "nan") and the weights after `n` micro-batches,
    with an inf in micro-batch `bad` (no loss scale: what optax's wrappers see)."""
    params, state, seen = {"w": jnp.ones(3)}, opt.init({"w": jnp.ones(3)}), []
    update = jax.jit(opt.update)  # (one program for the n steps)
    for i in range(n):
        g = {"w": jnp.array([jnp.inf if i == bad else 1.0, 2.0, 3.0])}
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
        u = np.asarray(updates["w"])
        seen.append("nan" if not np.isfinite(u).all() else "0" if not u.any() else "u")
    return seen, params


def test_what_optax_and_flax_do_in_the_same_setup():
    """The guide's table: optax's `apply_if_finite` and Flax's `DynamicScale` with `MultiSteps`
    on an inf in micro-batch 5 of windows of 2."""
    inner = optax.chain(optax.clip_by_global_norm(3.0), optax.adam(1e-2))
    inside = optax.MultiSteps(optax.apply_if_finite(inner, 3), every_k_schedule=2)
    seen, params = outcome(inside)
    assert seen[5:10] == ["0"] * 5 and "nan" in seen[10:]  # skipped windows, then NaN applied
    assert not np.isfinite(params["w"]).all()
    outside = optax.apply_if_finite(optax.MultiSteps(inner, every_k_schedule=2), 3)
    seen, params = outcome(outside)
    assert seen[4:8] == ["0", "0", "u", "0"]  # micro-batch 5 dropped: 4 and 6 make a window
    assert np.isfinite(params["w"]).all()

    from flax.training.dynamic_scale import DynamicScale

    def flax_run(select):
        opt = optax.MultiSteps(inner, every_k_schedule=2)

        @jax.jit
        def step(scaler, state, params, x):
            loss = lambda p: jnp.sum(p["w"] * x)  # noqa: E731
            scaler, is_fin, _, grads = scaler.value_and_grad(loss)(params)
            updates, new_state = opt.update(grads, state, params)
            if select:  # Flax's examples: keep the old state where the gradients overflowed
                new_state = jax.tree.map(lambda a, b: jnp.where(is_fin, a, b), new_state, state)
                updates = jax.tree.map(lambda u: jnp.where(is_fin, u, 0.0), updates)
            return scaler, new_state, optax.apply_updates(params, updates)

        scaler, params = DynamicScale(growth_interval=2, scale=64.0), {"w": jnp.ones(3)}
        state, scales = opt.init(params), []
        for i in range(12):
            x = jnp.array([jnp.inf if i == 5 else 1.0, 2.0, 3.0])
            scaler, state, params = step(scaler, state, params, x)
            scales.append(float(scaler.scale))
        return scales, params

    scales, params = flax_run(select=True)
    assert np.isfinite(params["w"]).all()
    assert scales[4:6] == [128.0, 64.0] and scales[2] == 128.0  # grows and backs off per micro
    _, params = flax_run(select=False)
    assert not np.isfinite(params["w"]).all()
