"""`nonfinite="raise"` (PyTorch's `error_if_nonfinite`), the state's `scale` and `threshold`,
and `axis_name` errors that need no second device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optclip

GOOD = {"b": jnp.array([12.0]), "w": jnp.array([3.0, 4.0])}
BAD = {"b": jnp.array([np.inf]), "w": jnp.array([3.0, np.nan])}

RAISING = {
    "global_clip": lambda: optclip.global_clip(1.0, nonfinite="raise"),
    "autoclip": lambda: optclip.autoclip(nonfinite="raise"),
    "zclip": lambda: optclip.zclip(nonfinite="raise"),
    "clipped-global": lambda: optclip.clipped(
        optax.sgd(1.0), global_clipnorm=1.0, nonfinite="raise"
    ),
    "clipped-clipvalue": lambda: optclip.clipped(optax.sgd(1.0), clipvalue=1.0, nonfinite="raise"),
}
MESSAGE = (
    r"the norm of the updates is (nan|inf), not finite; leaves with NaN or inf: "
    r"`\['b'\]`, `\['w'\]`"
)


@pytest.mark.parametrize("name", RAISING)
def test_raise_eagerly_names_the_leaves_and_changes_nothing(name):
    tx = RAISING[name]()
    state = tx.init(GOOD)
    updates, state = tx.update(GOOD, state, GOOD)  # a finite step passes
    before = jax.tree.map(np.array, state)
    # (clipped's global_clipnorm is a global_clip inside it, which reports)
    what = {"clipped-global": "global_clip", "clipped-clipvalue": "clipped"}.get(name, name)
    with pytest.raises(optclip.NonFiniteNormError, match=rf"`{what}`: " + MESSAGE):
        tx.update(BAD, state, GOOD)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        assert np.array_equal(a, b)  # the state is what it was (and inputs are never changed)


@pytest.mark.parametrize("name", ["global_clip", "clipped-clipvalue"])
def test_raise_under_jit_raises_when_the_step_runs(name):
    tx = RAISING[name]()
    step = jax.jit(tx.update)
    state = tx.init(GOOD)
    updates, state = step(GOOD, state, GOOD)
    assert np.all(np.isfinite(updates["w"]))  # a finite step: no callback, no error
    with pytest.raises(Exception, match=MESSAGE) as info:
        jax.block_until_ready(step(BAD, state, GOOD))
    assert "NonFiniteNormError" in str(info.value)


@pytest.mark.parametrize("name", ["global_clip", "zclip", "clipped-clipvalue"])
def test_reraise_errors_gives_back_the_error_from_a_jitted_step(name, capfd, caplog):
    """The README's way: `except optclip.NonFiniteNormError` around a jitted step, inside
    `optclip.reraise_errors()`, catches the error itself, with no traceback on stderr."""
    tx = RAISING[name]()
    step = jax.jit(tx.update)
    state = tx.init(GOOD)
    capfd.readouterr()
    with pytest.raises(optclip.NonFiniteNormError, match=MESSAGE) as info:
        with optclip.reraise_errors():
            jax.block_until_ready(step(BAD, state, GOOD))
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert capfd.readouterr().err == ""
    assert "jax.debug.callback failed" not in caplog.text  # JAX's report of it is left out
    with optclip.reraise_errors():  # a finite step afterwards runs as usual
        updates, _ = step(GOOD, state, GOOD)
    assert np.all(np.isfinite(updates["w"]))


def test_reraise_errors_as_a_decorator_and_for_vmap():
    tx = optclip.global_clip(1.0, nonfinite="raise")

    @optclip.reraise_errors()
    @jax.jit
    def step(grads):
        return tx.update(grads, tx.init(grads))[0]

    with pytest.raises(optclip.NonFiniteNormError, match=MESSAGE):
        jax.block_until_ready(step(BAD))
    np.testing.assert_allclose(step(GOOD)["w"], [3 / 13, 4 / 13], rtol=1e-6)
    batched = jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[0]))
    grads = jax.tree.map(lambda x: jnp.stack([x, x]), GOOD)
    grads["w"] = grads["w"].at[1, 0].set(np.nan)
    with pytest.raises(optclip.NonFiniteNormError, match=r"leaves with NaN or inf: `\['w'\]`"):
        with optclip.reraise_errors():
            jax.block_until_ready(batched(grads))


def test_reraise_errors_lets_everything_else_through(caplog):
    def failing(x):
        raise KeyError("not optclip's")

    @jax.jit
    def step(x):
        jax.debug.callback(failing, x)
        return x

    with pytest.raises(jax.errors.JaxRuntimeError, match="not optclip's"):
        with optclip.reraise_errors():
            jax.block_until_ready(step(jnp.ones(2)))
    assert "jax.debug.callback failed" in caplog.text  # JAX's own report is kept
    with pytest.raises(ValueError, match="eager"):
        with optclip.reraise_errors():
            raise ValueError("eager")


def test_the_norm_itself_overflowing_is_reported_too():
    tx = optclip.global_clip(1.0, nonfinite="raise")
    big = {"w": jnp.full((4,), 3e38, jnp.float32)}
    with pytest.raises(optclip.NonFiniteNormError, match="none \\(the norm itself overflowed\\)"):
        tx.update(big, tx.init(big))


def test_raise_is_not_a_policy_of_the_per_leaf_clips():
    with pytest.raises(ValueError, match="`nonfinite` must be one of 'propagate', 'zero', 'raise'"):
        optclip.global_clip(1.0, nonfinite="error")


@pytest.mark.parametrize("nonfinite, scale", [("propagate", np.nan), ("zero", 0.0)])
def test_state_keeps_the_scale_and_threshold(nonfinite, scale, mode):
    tx = optclip.global_clip(6.5, nonfinite=nonfinite)
    step = jax.jit(tx.update) if mode == "jit" else tx.update
    state = tx.init(GOOD)
    assert float(state.scale) == 1.0 and float(state.threshold) == 6.5
    _, state = step(GOOD, state)
    assert float(state.scale) == 0.5 and float(state.threshold) == 6.5
    _, state = step(jax.tree.map(lambda g: g / 100, GOOD), state)
    assert float(state.scale) == 1.0
    _, state = step(BAD, state)
    np.testing.assert_equal(float(state.scale), scale)
    assert int(state.nonfinite_count) == 1 and int(state.clip_count) == 1


def test_threshold_follows_a_schedule_and_is_never_negative():
    tx = optclip.global_clip(optax.linear_schedule(-1.0, 3.0, 4))
    state = tx.init(GOOD)
    thresholds = []
    for _ in range(4):
        _, state = tx.update(GOOD, state)
        thresholds.append(float(state.threshold))
    assert thresholds == [0.0, 0.0, 1.0, 2.0]


def test_an_axis_name_outside_shard_map_and_pmap_is_an_error():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "`axis_name` names mesh axis 'data', which is not bound: no mesh axis is bound here "
            "(`axis_name` is for code inside `jax.shard_map` or `jax.pmap`; under `jax.jit` with "
            "sharded arrays leave it None)."
        ),
    ):
        jax.jit(lambda g: optclip.global_norm(g, axis_name="data"))(GOOD)
    tx = optclip.global_clip(1.0, axis_name={"b": None, "w": "data"})
    with pytest.raises(ValueError, match="names mesh axis 'data', which is not bound"):
        tx.update(GOOD, tx.init(GOOD))


def test_an_unbound_axis_lists_the_bound_ones():
    batch = jax.tree.map(lambda g: jnp.stack([g, g]), GOOD)
    with pytest.raises(
        ValueError,
        match="names mesh axis 'batch', which is not bound: the mesh axes bound here are 'i'",
    ):
        jax.vmap(lambda g: optclip.global_norm(g, axis_name="batch"), axis_name="i")(batch)
    # a bound one works (vmap's axis stands in for a mesh axis: the norm of the whole batch)
    norms = jax.vmap(lambda g: optclip.global_norm(g, axis_name="i"), axis_name="i")(batch)
    np.testing.assert_allclose(np.asarray(norms), [13 * np.sqrt(2)] * 2, rtol=1e-6)


def test_auto_axis_name_outside_shard_map_reduces_nothing(mode):
    f = (
        jax.jit(optclip.global_norm, static_argnames="axis_name")
        if mode == "jit"
        else optclip.global_norm
    )
    assert float(f(GOOD, axis_name="auto")) == 13.0
