"""No host sync on the step: every public transformation, wrapper and function of optclip,
jitted, runs under ``jax.transfer_guard("disallow")`` with no implicit transfer.

The names come from ``optclip.__all__``, so a new public name is covered as soon as it is
exported: `CASES` must say how to build and run it (or why there is nothing to run), and the
test fails, naming it, until it does. Arguments, parameters and states are put on the device
explicitly (``jax.device_put``) before the guard; then the first call (tracing, compiling) and
several steps run under it, ``optclip.metrics`` of the state inside the jitted step and outside
it. (Eager, op-by-op calls are not covered: every Python number in an eager JAX operation is a
host-to-device transfer, in any JAX code.)

The guard stops implicit transfers between host and device in either direction: a NumPy array
or Python scalar turned into a device array when a jitted function is called or when the step
runs (``jnp.asarray(np_value)`` outside a trace), a device value read back (``float(x)``,
``np.asarray(x)``, ``bool(x)``, printing). It does not see what happens inside a compiled
program (a host callback, as ``nonfinite="raise"`` makes, is only called on a non-finite step,
and is checked here not to be on a finite one), nor transfers written explicitly
(``jax.device_put``/``jax.device_get``), nor constants folded into the program at compile time.
The ghost engine computes a weight's multiplier (``w * jnp.sqrt(1 / d)``, a scalar the loss
holds on a device) while the loss is traced, once per compilation: those transfers, and only
those, it allows itself (`clipped_grad`'s second case runs one under the guard).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optclip

HELD = jnp.asarray(0.5, jnp.float32)  # (a multiplier the loss holds on a device)


class Transform(NamedTuple):
    """An optax transformation to run for a few steps: ``tx.update(grads, state, params)``
    (`raises`: made with ``nonfinite="raise"``, so its program holds a host callback)."""

    make: Callable[[], optax.GradientTransformation]
    raises: bool = False


class Function(NamedTuple):
    """A pure function to run jitted on the gradients (`batched`: with a leading batch axis)."""

    call: Callable
    batched: bool = False


SCHEDULE = optax.linear_schedule(3.0, 1.0, transition_steps=4)

# What each public name is, and how to run it. Classes and `metrics` have nothing to run of
# their own: the states are made by their transformations, and `metrics` runs inside every
# transformation's step below.
CASES: dict[str, object] = {
    "AGCState": "the state of `agc`",
    "AdaGCState": "the state of `adagc`",
    "AutoClipState": "the state of `autoclip`",
    "ClippedState": "the state of `clipped`",
    "GlobalClipState": "the state of `global_clip`",
    "GroupNorms": "a state field (`group_norms=`)",
    "NonFiniteNormError": "an exception class",
    "AxisNameError": "an exception class",
    "GuardedState": "the state of `guarded`",
    "LossScaleState": "a field of `guarded`'s state",
    "AccumulationState": "a field of `guarded`'s state (`accumulation_steps=`)",
    "SpikeState": "a field of `guarded`'s state",
    "DynamicLossScale": "the settings of `guarded`'s loss scale (run with `guarded`)",
    "SpikeSkip": "the settings of `guarded`'s spike test (run with `guarded`)",
    "loss_scale": "read from a `guarded` state in test_loss_scale_transfers_nothing",
    "guarded": [
        Transform(
            lambda: optclip.guarded(
                optax.adam(1e-3),
                clip=optclip.global_clip(1.0, group_norms="leaf"),
                loss_scale=True,
                skip_spikes=optclip.SpikeSkip(window=4, k=6.0, min_history=2),
            )
        ),
        Transform(lambda: optclip.guarded(optax.sgd(0.1), clip=optclip.norm_clip(0.5))),
        Transform(
            lambda: optclip.guarded(
                optax.adam(1e-3),
                clip=optclip.global_clip(1.0),
                loss_scale=True,
                accumulation_steps=2,
            )
        ),
        Transform(
            lambda: optclip.guarded(
                optax.sgd(0.1), clip=optclip.adagc(warmup_steps=2), loss_scale=True
            )
        ),
    ],
    "reraise_errors": "a context manager on the host, around a step (no device work of its own)",
    "force_ghost_route": "a context manager on the host, around tracing (no device work)",
    "ScheduleState": "the state of a per-leaf clip with a schedule",
    "ZClipState": "the state of `zclip`",
    "metrics": "runs inside every transformation's step",
    "value_clip": [
        Transform(lambda: optclip.value_clip(0.5)),
        Transform(lambda: optclip.value_clip(None, 1.0)),
    ],
    "norm_clip": [
        Transform(lambda: optclip.norm_clip(1.0)),
        Transform(lambda: optclip.norm_clip(SCHEDULE)),
    ],
    "average_norm_clip": [Transform(lambda: optclip.average_norm_clip(SCHEDULE))],
    "block_rms_clip": [Transform(lambda: optclip.block_rms_clip(0.3))],
    "global_clip": [
        Transform(lambda: optclip.global_clip(1.0)),
        Transform(
            lambda: optclip.global_clip(SCHEDULE, group_norms="leaf", nonfinite="raise"),
            raises=True,
        ),
        Transform(lambda: optclip.global_clip(1.0, ord=math.inf, nonfinite="zero")),
        Transform(lambda: optax.inject_hyperparams(optclip.global_clip)(max_norm=1.0)),
    ],
    "clipped": [
        Transform(lambda: optclip.clipped(optax.adam(1e-3), global_clipnorm=1.0, nonfinite="skip")),
        Transform(
            lambda: optclip.clipped(optax.sgd(0.1), clipnorm=SCHEDULE, nonfinite="raise"),
            raises=True,
        ),
        Transform(lambda: optclip.clipped(optax.adam(1e-3), clipvalue=0.5, nonfinite="zero")),
    ],
    "agc": [Transform(lambda: optclip.agc(0.01, group_norms=1))],
    "autoclip": [
        Transform(
            lambda: optclip.autoclip(25.0, history=8, nonfinite="raise", group_norms=1), raises=True
        ),
    ],
    "zclip": [
        Transform(lambda: optclip.zclip(warmup_steps=2, nonfinite="raise"), raises=True),
        Transform(lambda: optclip.zclip(max_norm=SCHEDULE, warmup_steps=2, group_norms="leaf")),
        Transform(lambda: optax.inject_hyperparams(optclip.zclip)(warmup_steps=2, max_norm=2.0)),
    ],
    "adagc": [
        Transform(
            lambda: optclip.adagc(warmup_steps=2, nonfinite="raise", group_norms=1), raises=True
        ),
        Transform(lambda: optclip.adagc(max_norm=SCHEDULE, warmup_steps=2, nonfinite="zero")),
        Transform(lambda: optax.inject_hyperparams(optclip.adagc)(warmup_steps=2)),
    ],
    "global_norm": [
        Function(optclip.global_norm),
        Function(lambda g: optclip.global_norm(g, ord=3)),
    ],
    "clip_by_value": [Function(lambda g: optclip.clip_by_value(g, -0.5, 0.5))],
    "clip_by_norm": [Function(lambda g: optclip.clip_by_norm(g, 1.0))],
    "clip_by_average_norm": [Function(lambda g: optclip.clip_by_average_norm(g, 0.1))],
    "clip_by_block_rms": [Function(lambda g: optclip.clip_by_block_rms(g, 0.3))],
    "clip_by_global_norm": [Function(lambda g: optclip.clip_by_global_norm(g, 1.0))],
    "per_example_clip": [Function(lambda g: optclip.per_example_clip(g, 1.0), batched=True)],
    "check_split": [  # under a named vmap (as pmap runs it): the examples are the devices
        Function(
            lambda g: jax.vmap(
                lambda x: (optclip.check_split(x, axis_name="i"), x)[1], axis_name="i"
            )(g),
            batched=True,
        )
    ],
    "per_example_layer_clip": [
        Function(lambda g: optclip.per_example_layer_clip(g, 1.0, uniform=False), batched=True)
    ],
    "clipped_grad": [  # the batch of gradients as the examples of a small loss
        Function(
            lambda g: optclip.clipped_grad(
                lambda w, b: (
                    jnp.mean(jnp.tanh(jnp.einsum("bij,ij->b", b["dense"], w)))
                    + jnp.mean(b["bias"] @ w.T)
                ),
                l2_clip_norm=1.0,
                return_grad_norms=True,
            )(jnp.ones((4, 3)), g),
            batched=True,
        ),
        Function(  # the weight times muP's numbers: computed in the loss, and held on a device
            lambda g: optclip.clipped_grad(
                lambda w, b: jnp.mean(
                    jnp.tanh(jnp.einsum("bij,ij->b", b["dense"], w * jnp.sqrt(1 / 9) * HELD))
                ),
                l2_clip_norm=1.0,
                return_grad_norms=True,
            )(jnp.ones((4, 3)), g),
            batched=True,
        ),
    ],
    "ClippedGradFn": "the function `clipped_grad` returns (run in its case)",
    "AuxiliaryOutput": "a result class of `clipped_grad`",
    "ghost_report": "reads shapes when called, on the host (no device work)",
    "GhostReport": "a result class of `ghost_report`",
    "LeafReport": "a result class of `ghost_report`",
}


def params_and_grads(steps=4, batch=None):
    """Small parameters and a few steps of gradients (the third one larger), as NumPy."""
    rng = np.random.default_rng(0)
    shapes = {"dense": (4, 3), "bias": (3,), "scale": ()}
    lead = () if batch is None else (batch,)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [
        {
            k: (rng.standard_normal(lead + s) * (10.0 if t == 2 else 0.5)).astype(np.float32)
            for k, s in shapes.items()
        }
        for t in range(steps)
    ]
    return params, grads


def test_every_public_name_has_a_case():
    missing = sorted(set(optclip.__all__) - set(CASES))
    assert not missing, (
        f"public names with no entry in tests/test_host_sync.py's CASES: {missing}. Add how to "
        "build and run each (a Transform or Function), or say why there is nothing to run."
    )
    assert not sorted(set(CASES) - set(optclip.__all__)), "CASES names a name not exported"


def _cases(kind):
    return [
        pytest.param(case, id=f"{name}[{i}]")
        for name, cases in CASES.items()
        if isinstance(cases, list)
        for i, case in enumerate(cases)
        if isinstance(case, kind)
    ]


def _placed_step(case, steps=4):
    """A jitted step of `case` that also logs its metrics, and its arguments, all placed on the
    device (explicitly: before any guard)."""
    tx = case.make()
    params, grads = params_and_grads(steps)
    params, grads = jax.device_put(params), jax.device_put(grads)
    state = jax.device_put(tx.init(params))

    @jax.jit
    def step(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return updates, state, optclip.metrics(state)

    return step, grads, state, params


@pytest.mark.every_case
@pytest.mark.parametrize("case", _cases(Transform))
def test_transformation_step_transfers_nothing(case):
    step, grads, state, params = _placed_step(case)
    with jax.transfer_guard("disallow"):  # the first call (tracing, compiling) included
        for g in grads:
            updates, state, logged = step(g, state, params)
        outside = optclip.metrics(state)  # outside `jit` too (its own jitted gather)
        jax.block_until_ready((updates, state, logged, outside))
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(updates))
    assert sorted(outside) == sorted(logged)  # (a dict out of `jit` comes back key-sorted)
    # What the guard cannot see on the CPU backend (where device memory is host memory, so a
    # read-back is no transfer): a host callback in the program. Only "raise" has one.
    program = step.lower(grads[0], state, params).as_text()
    assert ("callback" in program) == case.raises


def test_raise_calls_the_host_only_on_a_nonfinite_step(monkeypatch):
    calls = []
    original = jax.debug.callback

    def counting(fn, *args, **kwargs):
        def counted(*a, **k):
            calls.append(None)
            return fn(*a, **k)

        return original(counted, *args, **kwargs)

    monkeypatch.setattr(jax.debug, "callback", counting)
    case = Transform(lambda: optclip.adagc(warmup_steps=2, nonfinite="raise"), raises=True)
    step, grads, state, params = _placed_step(case)
    bad = jax.device_put(dict(jax.device_get(grads[1]), bias=np.full(3, np.nan, np.float32)))
    with jax.transfer_guard("disallow"):
        for g in grads:
            _, state, _ = step(g, state, params)
        jax.block_until_ready(state)
        jax.effects_barrier()
        assert calls == []  # compiled in, never called on a finite step
        with pytest.raises(Exception, match=r"`adagc`: the norm of the updates is nan.*bias"):
            jax.block_until_ready(step(bad, state, params))
            jax.effects_barrier()
    assert calls == [None]


@pytest.mark.every_case
@pytest.mark.parametrize("case", _cases(Function))
def test_function_transfers_nothing(case):
    _, grads = params_and_grads(steps=2, batch=3 if case.batched else None)
    grads = jax.device_put(grads)
    fn = jax.jit(case.call)
    with jax.transfer_guard("disallow"):
        out = [fn(g) for g in grads]
        jax.block_until_ready(out)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))


def test_the_guard_does_catch_a_transfer():
    """The test above is not vacuous: an implicit transfer in the step is an error."""
    _, grads = params_and_grads(steps=1)
    grads = jax.device_put(grads[0])
    norm = jax.jit(optclip.global_norm)
    with jax.transfer_guard("disallow"):
        with pytest.raises(Exception, match="Disallowed host-to-device"):
            norm(grads, ord=np.float32(2.0))  # a NumPy scalar argument, sent every call
        with pytest.raises(Exception, match="Disallowed host-to-device"):
            grads["bias"] * 2.0  # eager arithmetic with a Python float
        if jax.default_backend() != "cpu":  # (on CPU a read-back copies nothing: allowed)
            with pytest.raises(Exception, match="Disallowed device-to-host"):
                float(norm(grads))


def test_loss_scale_transfers_nothing():
    """`optclip.loss_scale(state)`, read inside a jitted step, moves nothing to the host."""
    tx = optclip.guarded(optax.sgd(0.1), clip=optclip.global_clip(1.0), loss_scale=True)
    params, _ = params_and_grads(steps=1)
    state = jax.device_put(tx.init(jax.device_put(params)))
    read = jax.jit(optclip.loss_scale)
    with jax.transfer_guard("disallow"):
        scale = read(state)
        jax.block_until_ready(scale)
    assert float(scale) == 2.0**16
