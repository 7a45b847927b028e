"""`optclip.guarded`: dynamic loss scaling folded into the clip, true skipped steps, spike
skipping; against float64 references, PyTorch's GradScaler and jmp's DynamicLossScale."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from flax import nnx

import optclip

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _passes  # noqa: E402  (benchmarks/_passes.py: passes over the gradients in HLO)

PARAMS = {"b": jnp.zeros(3), "w": jnp.zeros((4, 5))}

CLIPS = {
    "none": lambda: None,
    "global_clip": lambda: optclip.global_clip(2.0),
    "global_clip-ord1": lambda: optclip.global_clip(2.0, ord=1, group_norms="leaf"),
    "norm_clip": lambda: optclip.norm_clip(0.5),
    "norm_clip-axes": lambda: optclip.norm_clip(0.3, axes=-1),
    "average_norm_clip": lambda: optclip.average_norm_clip(0.1),
    "block_rms_clip": lambda: optclip.block_rms_clip(0.3),
    "value_clip": lambda: optclip.value_clip(0.4),
    "agc": lambda: optclip.agc(0.05),
    "autoclip": lambda: optclip.autoclip(50.0, history=4),
    "zclip": lambda: optclip.zclip(warmup_steps=2, max_norm=3.0),
    "adagc": lambda: optclip.adagc(max_norm=2.0, warmup_steps=2),
    "optax.clip_by_global_norm": lambda: optax.clip_by_global_norm(2.0),
    "inject_hyperparams(global_clip)": lambda: optax.inject_hyperparams(optclip.global_clip)(2.0),
}


def gradient_steps(n, seed=0):
    return reference.gradient_steps(PARAMS, n, seed)


def params_like(seed=1):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in PARAMS.items()}


# ---------------------------------------------------------------------------------------------
# Loss scaling: the updates are those of "unscale, check finite, clip, apply".


@pytest.mark.parametrize(
    "clip, init_scale",
    [(clip, 2.0**15) for clip in CLIPS]
    + [(clip, 1000.0) for clip in ("global_clip", "norm_clip", "zclip", "none")],
)
def test_loss_scaled_updates_equal_the_unscaled_clip(clip, init_scale, mode):
    """Every clip, given gradients of the loss times the scale, gives the updates and the clip
    state that the same clip gives the unscaled gradients (float32 rounding); the scale is a
    power of two or not."""
    params = params_like()
    config = optclip.DynamicLossScale(init_scale=init_scale, growth_interval=2)
    guarded = optclip.guarded(optax.sgd(1.0), clip=CLIPS[clip](), loss_scale=config)
    plain_clip = CLIPS[clip]()
    plain = optax.sgd(1.0) if plain_clip is None else optax.chain(plain_clip, optax.sgd(1.0))
    step = reference.run(guarded.update, mode)
    plain_step = reference.run(plain.update, mode)
    state, plain_state = guarded.init(params), plain.init(params)
    for grads in gradient_steps(5):
        scale = float(optclip.loss_scale(state))
        scaled = jax.tree.map(lambda g, s=scale: np.float32(g * s), grads)
        unscaled = jax.tree.map(lambda g, s=scale: (g * s).astype(np.float64) / s, grads)
        updates, state = step(scaled, state, params)
        want, plain_state = plain_step(jax.tree.map(np.float32, unscaled), plain_state, params)
        for k in PARAMS:
            reference.assert_close(updates[k], want[k], np.float32, factor=4)
        order = 1.0 if clip.endswith("ord1") else 2.0  # the clip's own norm when it has one
        np.testing.assert_allclose(
            float(state.global_norm),
            reference.ref_global_norm(jax.tree.leaves(unscaled), order),
            rtol=1e-5,
        )
        if plain_clip is not None:
            clip_state = plain_state[0]
            for got, ref in zip(jax.tree.leaves(state.clip_state), jax.tree.leaves(clip_state)):
                reference.assert_close(got, ref, np.float32, factor=4)
    assert float(optclip.loss_scale(state)) == init_scale * 4  # grew twice, every 2 steps


@pytest.mark.parametrize("clip", ["global_clip", "norm_clip", "value_clip", "none"])
def test_updates_equal_float64_unscale_check_clip_apply(clip):
    """The float64 reference of PyTorch's sequence: unscale, check finite, clip, apply (sgd)."""
    guarded = optclip.guarded(optax.sgd(0.5), clip=CLIPS[clip](), loss_scale=True)
    step = jax.jit(guarded.update)
    state = guarded.init(PARAMS)
    for grads in gradient_steps(3, seed=4):
        scale = float(optclip.loss_scale(state))
        scaled = jax.tree.map(lambda g, s=scale: np.float32(g * s), grads)
        leaves = [reference.as_f64(x) / scale for x in jax.tree.leaves(scaled)]
        if clip == "global_clip":
            want, _ = reference.ref_clip_by_global_norm(leaves, 2.0)
        elif clip == "norm_clip":
            want = [reference.ref_clip_by_norm(x, 0.5) for x in leaves]
        elif clip == "value_clip":
            want = [np.clip(x, -0.4, 0.4) for x in leaves]
        else:
            want = leaves
        updates, state = step(scaled, state, PARAMS)
        for got, ref in zip(jax.tree.leaves(updates), want):
            reference.assert_close(got, -0.5 * ref, np.float32, factor=2)


@pytest.mark.parametrize("clip", list(CLIPS))
def test_an_overflow_is_a_true_skipped_step_and_lowers_the_scale(clip):
    params = params_like()
    opt = optclip.guarded(optax.adam(1e-2), clip=CLIPS[clip](), loss_scale=True)
    step = jax.jit(opt.update)
    state = opt.init(params)
    grads = gradient_steps(2)
    _, state = step(jax.tree.map(lambda g: g * 2.0**16, grads[0]), state, params)
    bad = dict(grads[1], w=grads[1]["w"].copy())
    bad["w"][1, 2] = np.inf
    updates, after = step(bad, state, params)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
    for old, new in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(after.inner_state)):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))  # bit for bit
    assert float(optclip.loss_scale(after)) == 2.0**15
    assert int(after.skip_count) == 1 and bool(after.skipped)
    assert int(after.scaler.overflow_count) == 1 and int(after.nonfinite_count) == 1
    assert int(after.scaler.growth_tracker) == 0 and int(state.scaler.growth_tracker) == 1
    assert not np.isfinite(float(after.global_norm))


def test_no_loss_scale_still_skips_nonfinite_steps(mode):
    opt = optclip.guarded(optax.sgd(1.0), clip=optclip.global_clip(1.0))
    state = opt.init(PARAMS)
    assert state.scaler is None and state.spikes is None
    step = reference.run(opt.update, mode)
    grads = gradient_steps(1)[0]
    updates, state = step(grads, state, PARAMS)
    want, _ = reference.ref_clip_by_global_norm(
        [reference.as_f64(grads["b"]), reference.as_f64(grads["w"])], 1.0
    )
    reference.assert_close(updates["b"], -want[0], np.float32)
    updates, state = step(jax.tree.map(lambda g: g * np.nan, grads), state, PARAMS)
    assert int(state.skip_count) == 1 and float(jnp.abs(updates["w"]).sum()) == 0.0
    with pytest.raises(ValueError, match="holds no dynamic loss scale"):
        optclip.loss_scale(state)


# ---------------------------------------------------------------------------------------------
# The scale's sequence: PyTorch's GradScaler and jmp's DynamicLossScale, value for value.

PATTERN = [1] * 7 + [0] + [1] * 3 + [0, 0, 0, 0] + [1] * 10 + [0] + [1] * 2 + [0] * 9 + [1] * 7


def scales_of_guarded(config, pattern):
    opt = optclip.guarded(optax.sgd(1.0), loss_scale=config)
    step = jax.jit(opt.update)
    state, out = opt.init(PARAMS), []
    for finite in pattern:
        value = 1.0 if finite else np.inf
        grads = jax.tree.map(lambda p, v=value: jnp.full(p.shape, v), PARAMS)
        _, state = step(grads, state, PARAMS)
        out.append(float(optclip.loss_scale(state)))
    return out


@pytest.mark.parametrize(
    "settings",
    [
        dict(init_scale=2.0**16, growth_interval=3, min_scale=1.0),
        dict(init_scale=8.0, growth_interval=2, min_scale=1.0),
        dict(
            init_scale=4.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3, min_scale=0.0
        ),
        dict(init_scale=2.0**126, growth_interval=1, min_scale=2.0**120),  # growth to inf
    ],
)
def test_scale_sequence_equals_the_reference_rule(settings):
    config = optclip.DynamicLossScale(**settings)
    want = reference.ref_loss_scales(
        [bool(f) for f in PATTERN],
        settings["init_scale"],
        settings.get("growth_factor", 2.0),
        settings.get("backoff_factor", 0.5),
        settings["growth_interval"],
        settings["min_scale"],
    )
    assert scales_of_guarded(config, PATTERN) == want
    if settings["init_scale"] == 2.0**126:
        assert max(want) == 2.0**127  # (2**128 would be inf: never grown to)


def test_scale_sequence_equals_jmp():
    jmp = pytest.importorskip("jmp")
    for init, period in ((2.0**15, 3), (8.0, 2)):
        loss_scale = jmp.DynamicLossScale(jnp.float32(init), period=period)
        want = []
        for finite in PATTERN:
            loss_scale = loss_scale.adjust(jnp.asarray(bool(finite)))
            want.append(float(loss_scale.loss_scale))
        config = optclip.DynamicLossScale(init_scale=init, growth_interval=period)
        assert scales_of_guarded(config, PATTERN) == want  # jmp's min_loss_scale is 1 too


@pytest.mark.slow
def test_scale_sequence_equals_pytorch_grad_scaler():
    torch = pytest.importorskip("torch")  # CPU: GradScaler("cpu") is real since torch 2.3
    for init, growth, backoff, interval in ((4.0, 2.0, 0.5, 3), (2.0**16, 4.0, 0.25, 2)):
        p = torch.nn.Parameter(torch.zeros(2))
        sgd = torch.optim.SGD([p], lr=0.0)
        scaler = torch.amp.GradScaler(
            "cpu",
            init_scale=init,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=interval,
        )
        want = []
        for finite in PATTERN:
            sgd.zero_grad()
            x = torch.tensor([1.0 if finite else float("inf"), 1.0])
            scaler.scale((p * x).sum()).backward()
            scaler.step(sgd)
            scaler.update()
            want.append(scaler.get_scale())
        config = optclip.DynamicLossScale(init, growth, backoff, interval, min_scale=0.0)
        assert scales_of_guarded(config, PATTERN) == want  # PyTorch has no lower bound


# ---------------------------------------------------------------------------------------------
# Skipping spikes: against a NumPy re-statement on planted spikes.


def planted(n, seed, spikes, nonfinite=(), with_loss=True):
    rng = np.random.default_rng(seed)
    norms = 1.0 + 0.1 * rng.standard_normal(n) + np.linspace(0, 0.5, n)  # a slow drift
    losses = 3.0 - np.linspace(0, 1, n) + 0.02 * rng.standard_normal(n)
    for step, (what, factor) in spikes.items():
        (norms if what == "norm" else losses)[step] *= factor
    for step in nonfinite:
        norms[step] = np.inf
    return norms, (losses if with_loss else [None] * n)


@pytest.mark.parametrize("with_loss", [True, False])
@pytest.mark.parametrize("loss_scale", [None, True])
def test_spike_skips_equal_numpy_restatement(with_loss, loss_scale):
    window, k, min_history = 16, 4.0, 8
    spikes = {
        12: ("norm", 30.0),
        30: ("norm", 5.0),
        31: ("norm", 6.0),
        40: ("loss", 1.5),
        50: ("norm", 0.1),
    }  # (a step far *below* the mean is no spike)
    norms, losses = planted(60, 3, spikes, nonfinite=(35, 36), with_loss=with_loss)
    want_skips, want_limits = reference.ref_spike_skips(norms, losses, window, k, min_history)
    config = optclip.SpikeSkip(window=window, k=k, min_history=min_history)
    opt = optclip.guarded(optax.adam(0.1), skip_spikes=config, loss_scale=loss_scale)
    step = jax.jit(opt.update)
    state = opt.init(PARAMS)
    direction = jax.tree.map(lambda p: np.full(p.shape, 1 / np.sqrt(23), np.float32), PARAMS)
    skips = []
    for norm, loss, limits in zip(norms, losses, want_limits):
        scale = 1.0 if loss_scale is None else float(optclip.loss_scale(state))
        grads = jax.tree.map(lambda d, n=norm * scale: np.float32(d * n), direction)
        extra = {} if loss is None else {"value": jnp.float32(loss)}
        before = state.inner_state
        updates, state = step(grads, state, PARAMS, **extra)
        skips.append(bool(state.skipped))
        if skips[-1]:
            assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
            for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(state.inner_state)):
                np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
        np.testing.assert_allclose(float(state.spikes.norm_threshold), limits[0], rtol=1e-5)
        np.testing.assert_allclose(float(state.spikes.loss_threshold), limits[1], rtol=1e-5)
    assert skips == want_skips
    expected = {12, 30, 31, 35, 36} | ({40} if with_loss else set())
    assert {i for i, s in enumerate(skips) if s} == expected  # the planted spikes, no others
    assert int(state.spikes.spike_count) == len(expected) - 2
    assert int(state.nonfinite_count) == 2 and int(state.skip_count) == len(expected)
    assert int(state.spikes.filled) == window


def test_a_lasting_change_of_level_is_caught_up_with():
    """Spikes enter the window (as in OLMo-core): after a lasting jump the skips stop."""
    opt = optclip.guarded(optax.sgd(1.0), skip_spikes=optclip.SpikeSkip(window=16))  # k=6
    step = jax.jit(opt.update)
    state = opt.init(PARAMS)
    rng = np.random.default_rng(0)
    skipped = []
    for i in range(60):
        level = 1.0 if i < 30 else 10.0
        grads = jax.tree.map(
            lambda p, n=level: np.float32(n * (1 + 0.05 * rng.standard_normal(p.shape))), PARAMS
        )
        _, state = step(grads, state, PARAMS)
        skipped.append(bool(state.skipped))
    assert skipped[30] and not any(skipped[:30]) and not any(skipped[32:])


# ---------------------------------------------------------------------------------------------
# Composition: optax wrappers, inject_hyperparams, lax.scan, Flax NNX, checkpoints.


def test_accumulating_inside_chain_with_inject_hyperparams():
    """Gradient accumulation inside the guard (`MultiSteps` around a loss-scaled guard cannot
    recover from an overflow: tests/test_accumulation.py)."""
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    guarded = optclip.guarded(
        inner,
        clip=optclip.global_clip(1.0),
        loss_scale=optclip.DynamicLossScale(2.0**8, growth_interval=2),
        skip_spikes=optclip.SpikeSkip(window=4, min_history=2),
        accumulation_steps=2,
    )
    opt = optax.chain(optax.identity(), guarded)
    state = opt.init(PARAMS)
    step = jax.jit(opt.update)
    for grads in gradient_steps(8):
        scale = optclip.loss_scale(state)
        grads = jax.tree.map(lambda g, s=scale: g * s, grads)
        _, state = step(grads, state, PARAMS, value=jnp.float32(1.0))
    metrics = optclip.metrics(state)
    assert float(metrics["loss_scale/loss_scale"]) == 2.0**10  # 4 inner steps: grew twice
    assert int(metrics["guarded/step"]) == 4 and int(metrics["global_clip/step"]) == 4
    assert set(metrics) >= {
        "guarded/global_norm",
        "guarded/skipped",
        "guarded/skip_count",
        "guarded/nonfinite_count",
        "loss_scale/growth_tracker",
        "loss_scale/overflow_count",
        "skip_spikes/spike_count",
        "skip_spikes/norm_threshold",
        "skip_spikes/loss_threshold",
        "skip_spikes/filled",
    }
    # The inner optimizer's hyperparameters are traced: a new value needs no new trace.
    compiled = step._cache_size()
    state[1].inner_state.hyperparams["learning_rate"] = jnp.float32(0.5)
    step(grads, state, PARAMS, value=jnp.float32(1.0))
    assert step._cache_size() == compiled


def test_lax_scan_training_loop_equals_python_loop():
    opt = optclip.guarded(
        optax.adam(0.05),
        clip=optclip.global_clip(1.0),
        loss_scale=optclip.DynamicLossScale(2.0**4, growth_interval=3),
        skip_spikes=optclip.SpikeSkip(window=8, k=3.0, min_history=4),
    )
    data = np.random.default_rng(0).standard_normal((24, 5)).astype(np.float32)
    data[9] *= np.float32(1e4)  # a spike
    data[13, 0] = np.inf  # and an overflow (NumPy: building them compiles nothing)

    def loss_fn(params, x):
        return jnp.sum((params["w"] @ x - 1.0) ** 2) + jnp.sum(params["b"] ** 2)

    def step(carry, x):
        params, state = carry
        scale = optclip.loss_scale(state)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, x) * scale)(params)
        updates, state = opt.update(grads, state, params, value=loss / scale)
        return (optax.apply_updates(params, updates), state), (loss / scale, state.skipped)

    params = {"b": jnp.ones(3), "w": jnp.ones((4, 5))}
    (scanned, scan_state), (_, skipped) = jax.lax.scan(step, (params, opt.init(params)), data)
    carry = (params, opt.init(params))
    for x in data:
        carry, _ = jax.jit(step)(carry, x)
    for a, b in zip(jax.tree.leaves((scanned, scan_state)), jax.tree.leaves(carry)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert bool(skipped[9]) and bool(skipped[13])  # the spike and the overflow
    assert (
        int(scan_state.skip_count) == int(np.sum(skipped)) and int(scan_state.nonfinite_count) == 1
    )
    assert float(optclip.loss_scale(scan_state)) > 2.0**4  # grew, once backed off


def test_flax_nnx_optimizer():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    model = Model(nnx.Rngs(0))
    opt = optclip.guarded(
        optax.sgd(0.1),
        clip=optclip.global_clip(1.0),
        loss_scale=True,
        skip_spikes=optclip.SpikeSkip(window=4, min_history=2),
    )
    optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        scale = optclip.loss_scale(optimizer.opt_state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2) * scale)(model)
        optimizer.update(model, grads, value=loss / scale)
        return loss / scale

    kernel = model.dense.kernel.get_value().copy()
    losses = [float(step(model, optimizer, jnp.full((4, 3), 1.0))) for _ in range(3)]
    assert losses[2] < losses[0]
    assert float(optclip.loss_scale(optimizer.opt_state)) == 2.0**16
    assert float(optclip.metrics(optimizer.opt_state)["guarded/step"]) == 3
    before = model.dense.kernel.get_value().copy()
    assert not np.array_equal(before, kernel)  # it trained
    step(model, optimizer, jnp.full((4, 3), jnp.inf))  # an overflow: the model is unchanged
    np.testing.assert_array_equal(model.dense.kernel.get_value(), before)
    assert float(optclip.loss_scale(optimizer.opt_state)) == 2.0**15


@pytest.mark.parametrize("accumulation_steps", [None, 2])
def test_state_keeps_its_structure_and_checkpoints(tmp_path, accumulation_steps):
    ocp = pytest.importorskip("orbax.checkpoint")
    opt = optclip.guarded(
        optax.adam(1e-3),
        clip=optclip.global_clip(1.0),
        loss_scale=True,
        skip_spikes=optclip.SpikeSkip(window=4),
        accumulation_steps=accumulation_steps,
    )
    state = opt.init(PARAMS)
    _, after = jax.jit(opt.update)(gradient_steps(1)[0], state, PARAMS, value=jnp.float32(2.0))
    assert jax.tree.structure(after) == jax.tree.structure(state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", after)
    checkpointer.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = checkpointer.restore(tmp_path / "state", target)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------------------------
# One read of the gradients: passes over them in the compiled step (structure, not timing).

SHAPES = {"w": (256, 256), "b": (256,)}


def step_passes(opt):
    grads = {k: jnp.ones(s) for k, s in SHAPES.items()}
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    return _passes.passes_of(lambda g, s, p: opt.update(g, s, p), (grads, opt.init(params), params))


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
@pytest.mark.parametrize(
    "clip", ["global_clip", "norm_clip", "value_clip", "agc", "autoclip", "zclip", "adagc", "none"]
)
def test_loss_scaling_costs_no_pass_over_the_gradients(clip):
    adam = optax.adam(1e-3)
    made = CLIPS[clip]()
    without = adam if made is None else optax.chain(made, adam)
    scaled = optclip.guarded(adam, clip=CLIPS[clip](), loss_scale=True, skip_spikes=True)
    extra = 1 if made is None or clip == "value_clip" else 0  # the global norm's one read
    assert step_passes(scaled) == step_passes(without) + extra


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_jmp_and_optax_read_the_gradients_more_often():
    jmp = pytest.importorskip("jmp")
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}

    def jmp_step(grads, state, scale, counter):
        loss_scale = jmp.DynamicLossScale(scale, counter)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_state = tx.update(grads, state, params)
        loss_scale = loss_scale.adjust(finite)
        new_state = jmp.select_tree(finite, new_state, state)
        updates = jmp.select_tree(finite, updates, jax.tree.map(jnp.zeros_like, updates))
        return updates, new_state, loss_scale.loss_scale, loss_scale.counter

    grads = {k: jnp.ones(s) for k, s in SHAPES.items()}
    theirs = _passes.passes_of(
        jmp_step, (grads, tx.init(params), jnp.float32(2.0**16), jnp.int32(0))
    )
    ours = step_passes(
        optclip.guarded(optax.adam(1e-3), clip=optclip.global_clip(1.0), loss_scale=True)
    )
    adam_alone = step_passes(optax.adam(1e-3))
    assert ours == adam_alone + 1  # the clip's one reduction; the rest is fused into adam
    assert theirs >= ours + 3  # unscale, all_finite, clip's norm, clip's scaling, select


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_pass_counter_counts_an_unscaled_copy():
    """The counter itself: a clip that is not optclip's gets a written-out unscaled copy."""
    opt = optclip.guarded(optax.adam(1e-3), clip=optax.clip_by_global_norm(1.0), loss_scale=True)
    chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    assert step_passes(opt) > step_passes(chain)


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(init_scale=0.0), ValueError, "`init_scale` must be a finite number > 0"),
        (dict(init_scale=float("inf")), ValueError, "`init_scale` must be a finite number"),
        (dict(growth_factor=0.5), ValueError, "`growth_factor` must be a finite number >= 1"),
        (dict(backoff_factor=1.5), ValueError, r"`backoff_factor` must be a number in \(0, 1\]"),
        (dict(growth_interval=0), ValueError, "`growth_interval` must be an int >= 1"),
        (dict(growth_interval=2.5), ValueError, "`growth_interval` must be an int >= 1"),
        (dict(min_scale=-1.0), ValueError, "`min_scale` must be a finite number >= 0"),
        (dict(init_scale=2.0, min_scale=4.0), ValueError, "`min_scale` must be <= `init_scale`"),
        (dict(init_scale=np.ones(2)), ValueError, "`init_scale` must be a scalar"),
    ],
)
def test_dynamic_loss_scale_checks_its_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        optclip.DynamicLossScale(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=1), ValueError, "`window` must be an int >= 2"),
        (dict(window=jnp.int32(8)), TypeError, "`window` sets the shape"),
        (dict(k=0.0), ValueError, "`k` must be a finite number > 0"),
        (dict(k=float("nan")), ValueError, "`k` must be a finite number > 0"),
        (dict(window=8, min_history=9), ValueError, r"`min_history` must be an int in \[2, win"),
        (dict(min_history=1), ValueError, r"`min_history` must be an int in \[2, window=128\]"),
    ],
)
def test_spike_skip_checks_its_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        optclip.SpikeSkip(**kwargs)


def test_guarded_checks_its_arguments():
    with pytest.raises(TypeError, match="`optimizer` must be an optax.GradientTransformation"):
        optclip.guarded(optax.adam)
    with pytest.raises(TypeError, match="`clip` must be an optax.GradientTransformation"):
        optclip.guarded(optax.adam(1e-3), clip=optclip.global_clip)
    with pytest.raises(TypeError, match="`loss_scale` must be None, True"):
        optclip.guarded(optax.adam(1e-3), loss_scale=2.0**16)
    with pytest.raises(TypeError, match="`skip_spikes` must be None, True"):
        optclip.guarded(optax.adam(1e-3), skip_spikes=128)
    opt = optclip.guarded(optax.sgd(1.0), skip_spikes=True)
    with pytest.raises(ValueError, match=r"`value` \(the loss, for the spike test\) must be a 0-d"):
        opt.update(PARAMS, opt.init(PARAMS), PARAMS, value=jnp.ones(3))
    two = optax.chain(
        optclip.guarded(optax.sgd(1.0), loss_scale=True),
        optclip.guarded(optax.sgd(1.0), loss_scale=True),
    )
    with pytest.raises(ValueError, match="holds 2 dynamic loss scales"):
        optclip.loss_scale(two.init(PARAMS))


def test_defaults_are_pytorch_and_olmo_core():
    assert optclip.guarded(optax.sgd(1.0), loss_scale=True, skip_spikes=True).init(
        PARAMS
    ).spikes.norms.shape == (128,)
    config = optclip.DynamicLossScale()
    assert (config.init_scale, config.growth_factor, config.backoff_factor) == (65536.0, 2.0, 0.5)
    assert (config.growth_interval, config.min_scale) == (2000, 1.0)
    spikes = optclip.SpikeSkip()
    assert (spikes.window, spikes.k, spikes.min_history) == (128, 6.0, 64)
