"""Gradient accumulation inside :func:`optclip.guarded`: the micro-batches' gradients summed in
the state, the window's step taken on their mean, and the sum restarted from exact zeros.

Unlike ``optax.MultiSteps``, whose accumulator restarts as ``(1 - emit) * acc`` (``0 * inf`` is
NaN, so one overflowing micro-batch poisons every later window), the sum restarts from zeros
whatever it held: a window holding an overflow is skipped as a whole and the next one starts
clean."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip import _checks
from optclip.clips import _steps


class AccumulationState(NamedTuple):
    """The running sum of a window's micro-batches, inside :class:`GuardedState`
    (``state.accumulation``)."""

    grads: optax.Updates  # the sum of this window's gradients so far (in `sum_dtype`)
    loss_sum: jax.Array  # the sum of this window's losses (``value=``) so far, float32
    micro_step: jax.Array  # micro-batches in this window so far: 0 .. steps - 1


def check(steps) -> int | None:
    """`guarded`'s `accumulation_steps`: None or 1 (no accumulation), or an int >= 1."""
    if steps is None:
        return None
    _checks.check_count(steps, "accumulation_steps", static=True)
    return None if int(steps) == 1 else int(steps)


def sum_dtype(dtype):
    """The dtype a leaf's gradients are summed in: float32 for float16 and bfloat16 (k scaled
    float16 gradients can overflow float16 where each of them fits), the leaf's own otherwise."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return dtype


def init(params) -> AccumulationState:
    zeros = lambda p: jnp.zeros(jnp.shape(p), sum_dtype(jnp.result_type(p)))  # noqa: E731
    return AccumulationState(
        grads=jax.tree.map(zeros, params),
        loss_sum=jnp.zeros((), jnp.float32),
        micro_step=_steps.counter(),
    )


def add(state: AccumulationState, updates, loss) -> AccumulationState:
    """The sums with this micro-batch's gradients and loss (None: no ``value=``) added."""
    _checks.check_leaves(updates, "`guarded`'s update")
    grads = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), state.grads, updates)
    loss_sum = state.loss_sum if loss is None else state.loss_sum + loss.astype(jnp.float32)
    return AccumulationState(grads, loss_sum, state.micro_step + 1)


def restart(state: AccumulationState) -> AccumulationState:
    """Exact zeros (never ``0 * sum``: a NaN or inf sum does not outlive its window)."""
    return AccumulationState(
        grads=jax.tree.map(jnp.zeros_like, state.grads),
        loss_sum=jnp.zeros_like(state.loss_sum),
        micro_step=jnp.zeros_like(state.micro_step),
    )
