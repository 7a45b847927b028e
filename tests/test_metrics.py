"""`optclip.metrics`: every clip's state in any optimizer state, as plain arrays for a logger."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp  # comes with flax (the test extra)
import pytest
from flax import nnx

import optclip

PARAMS = {"b": jnp.zeros(1), "w": jnp.zeros(2)}
GRADS = {"b": jnp.array([12.0]), "w": jnp.array([3.0, 4.0])}  # global norm 13


def as_floats(metrics):
    return {name: float(value) for name, value in metrics.items()}


def test_metrics_of_a_chain(mode):
    opt = optax.chain(optclip.global_clip(6.5, group_norms="leaf"), optax.adam(1e-3))
    state = opt.init(PARAMS)
    step = jax.jit(opt.update) if mode == "jit" else opt.update
    _, state = step(GRADS, state, PARAMS)
    got = as_floats(optclip.metrics(state))
    assert got == {
        "global_clip/global_norm": 13.0,
        "global_clip/threshold": 6.5,
        "global_clip/clipped": 1.0,
        "global_clip/scale": 0.5,
        "global_clip/clip_count": 1.0,
        "global_clip/nonfinite_count": 0.0,
        "global_clip/step": 1.0,
        "global_clip/group_norm/b": 12.0,
        "global_clip/group_norm/w": 5.0,
    }
    _, state = step(jax.tree.map(lambda g: g / 13, GRADS), state, PARAMS)  # norm 1: not clipped
    got = as_floats(optclip.metrics(state))
    assert got["global_clip/clipped"] == 0.0 and got["global_clip/scale"] == 1.0
    assert got["global_clip/clip_count"] == 1.0 and got["global_clip/step"] == 2.0


def test_two_clips_of_one_kind_are_named_by_their_place():
    opt = optax.chain(optclip.global_clip(20.0), optclip.global_clip(6.5), optax.sgd(1.0))
    _, state = opt.update(GRADS, opt.init(PARAMS), PARAMS)
    with pytest.raises(Exception):  # noqa: B017 - what optax does: any error is the point
        optax.tree.get(state, "global_norm")
    got = as_floats(optclip.metrics(state))
    assert got["global_clip[0]/global_norm"] == 13.0 and got["global_clip[0]/clipped"] == 0.0
    assert got["global_clip[1]/global_norm"] == 13.0 and got["global_clip[1]/scale"] == 0.5


def test_every_kind_of_clip_and_wrapper():
    clips = optax.chain(
        optclip.autoclip(50.0, history=4),
        optclip.zclip(warmup_steps=1, max_norm=None),
        optclip.agc(0.1),
    )
    opt = optax.MultiSteps(optclip.clipped(clips, nonfinite="skip"), every_k_schedule=1)
    params = {"b": jnp.ones(1), "w": jnp.ones(2)}
    state = opt.init(params)
    _, state = opt.update(GRADS, state, params)
    _, state = opt.update(jax.tree.map(lambda g: g * np.nan, GRADS), state, params)
    got = as_floats(optclip.metrics(state))
    assert got["clipped/skip_count"] == 1.0
    assert got["autoclip/global_norm"] == 13.0 and got["autoclip/threshold"] == 13.0
    assert got["zclip/mean"] == 13.0 and got["zclip/std"] == 0.0
    assert got["zclip/finite_count"] == 1.0 and got["zclip/spike_count"] == 0.0
    assert set(got) >= {"agc/global_norm", "agc/threshold", "zclip/scale", "autoclip/clipped"}
    # (the skipped NaN step left the wrapped optimizer's state, clips included, as it was)


def test_masked_multi_transform_and_inject_hyperparams():
    inject = optax.inject_hyperparams(optclip.global_clip)
    opt = optax.chain(
        optax.masked(optclip.global_clip(1.0), {"b": True, "w": False}),
        optax.multi_transform(
            {"clip": inject(max_norm=2.0), "keep": optax.identity()}, {"b": "keep", "w": "clip"}
        ),
    )
    state = opt.init(PARAMS)
    _, state = opt.update(GRADS, state, PARAMS)
    got = as_floats(optclip.metrics(state))
    assert got["global_clip[0.inner_state]/global_norm"] == 12.0  # the masked clip: b only
    key = "global_clip[1.inner_states.clip.inner_state.inner_state]"
    assert got[f"{key}/global_norm"] == 5.0 and got[f"{key}/threshold"] == 2.0


def test_empty_without_an_optclip_state():
    assert optclip.metrics(optax.adam(1e-3).init(PARAMS)) == {}


def test_values_are_fresh_arrays_that_survive_donation():
    opt = optax.chain(optclip.global_clip(1.0), optax.sgd(0.1))

    @jax.jit
    def step_and_log(state, grads):
        _, state = opt.update(grads, state, PARAMS)
        return state, optclip.metrics(state)  # inside jit too

    donating = jax.jit(lambda s, g: opt.update(g, s, PARAMS)[1], donate_argnums=0)
    state, logged = step_and_log(opt.init(PARAMS), GRADS)
    outside = optclip.metrics(state)
    state = donating(state, GRADS)  # the buffers of the logged state are gone
    assert float(logged["global_clip/global_norm"]) == 13.0
    assert float(outside["global_clip/global_norm"]) == 13.0
    assert all(isinstance(v, jax.Array) and v.shape == () for v in outside.values())


def test_flax_nnx_optimizer_state_gives_each_step_its_own_values():
    """`optax.tree.get` on an NNX optimizer's state returns a Variable the next update
    overwrites; logging it gave every step the last step's value."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model,
        optax.chain(optclip.global_clip(1.0, group_norms="leaf"), optax.sgd(1e-3)),
        wrt=nnx.Param,
    )

    @nnx.jit
    def step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return optax.tree.norm(grads)

    logged, variables, norms = [], [], []
    for i in range(3):
        norms.append(float(step(model, optimizer, jnp.full((4, 3), i + 1.0))))
        logged.append(optclip.metrics(optimizer.opt_state))
        variables.append(optax.tree.get(optimizer.opt_state, "global_norm"))
    got = [float(m["global_clip/global_norm"]) for m in logged]
    np.testing.assert_allclose(got, norms, rtol=1e-6)
    assert len(set(got)) == 3
    assert len({float(v.get_value()) for v in variables}) == 1  # what users hit without metrics
    groups = [k for k in logged[0] if "/group_norm/" in k]
    assert groups == ["global_clip/group_norm/dense/bias", "global_clip/group_norm/dense/kernel"]
    total = math.hypot(*(float(logged[-1][k]) for k in groups))
    np.testing.assert_allclose(total, norms[-1], rtol=1e-6)


def test_state_checkpoints_with_orbax(tmp_path):
    opt = optax.chain(optclip.global_clip(1.0, group_norms="leaf"), optax.adam(1e-3))
    _, state = opt.update(GRADS, opt.init(PARAMS), PARAMS)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "state", state)
    checkpointer.wait_until_finished()
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, opt.init(PARAMS))
    restored = checkpointer.restore(tmp_path / "state", target)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert as_floats(optclip.metrics(restored)) == as_floats(optclip.metrics(state))
    assert float(restored[0].group_norms["b"]) == 12.0


def test_zclip_std_is_the_square_root_of_its_variance():
    # Two steps of different norms: a variance other than 0 or 1, so that its square root is
    # another number (the metric is the standard deviation, as its name says).
    opt = optclip.zclip(warmup_steps=2, max_norm=None)
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    for scale in (1.0, 3.0):
        _, state = opt.update({"w": jnp.array([3.0, 4.0]) * scale}, state, params)
    got = as_floats(optclip.metrics(state))
    var = float(np.asarray(optax.tree.get(state, "var")))
    assert var not in (0.0, 1.0)
    np.testing.assert_allclose(got["zclip/std"], np.sqrt(var), rtol=1e-6)
