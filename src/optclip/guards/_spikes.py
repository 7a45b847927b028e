"""Skipping spikes: a step whose gradient norm (or loss) is more than k standard deviations above
the mean of a rolling window (OLMo-core's `SkipStepOptimizer`, Levanter's `SkipStepConfig`).

The window is two fixed-size ring buffers in the state; the decision is made on the device, so
nothing is synced to the host. :func:`optclip.guarded` applies it."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from optclip import _checks
from optclip.clips import _steps


@dataclasses.dataclass(frozen=True)
class SpikeSkip:
    r"""Settings of spike skipping, for :func:`optclip.guarded`'s `skip_spikes`.

    With :math:`x_t` the global norm of the (unscaled) gradients at step :math:`t`, and
    :math:`\bar x, \sigma` the mean and standard deviation (with Bessel's correction, as
    ``torch.std``) of the last `window` recorded norms:

    .. math::
        \text{spike} \iff x_t > \bar x + k\,\sigma
        \quad\text{(once at least min\_history norms are recorded)}

    and the same test on the loss when it is given (``update(..., value=loss)``, optax's
    convention); a spike in either skips the step: the update is zeros and the wrapped
    optimizer's state is left exactly as it was.

    Every step whose gradients and loss are finite is recorded, spikes included, as in OLMo-core
    and Levanter: after a lasting change of level (a new data mixture, a learning-rate jump) the
    window catches up within a few steps instead of skipping every step from then on. A step
    whose gradients overflowed or whose loss is not finite is skipped and never recorded.

    OLMo-core's defaults are ``window=128, k=6`` (``rolling_interval_length``, ``sigma_factor``);
    it waits for ``max(20, window // 2)`` losses and tests ``|x - mean| > k std`` (a loss far
    *below* the mean is skipped too); Levanter waits for ``window // 2`` and uses the population
    standard deviation. Here only steps above the mean are spikes.

    Args:
      window: how many recent steps the statistics are taken over, an int >= 2 (default 128).
        It sets the state's shape.
      k: how many standard deviations above the mean is a spike, > 0 (default 6).
      min_history: recorded steps needed before any step can be a spike, an int in
        ``[2, window]`` (default ``max(2, window // 2)``: 64 for the default window, as
        OLMo-core and Levanter).

    Raises:
      ValueError: a value outside its range, or not 0-d.
      TypeError: `window` or `min_history` is a JAX array.

    Examples:
      >>> import optclip
      >>> optclip.SpikeSkip(window=64, k=4.0)
      SpikeSkip(window=64, k=4.0, min_history=32)
    """

    window: int = 128
    k: float = 6.0
    min_history: int | None = None

    def __post_init__(self):
        _checks.check_count(self.window, "window", static=True)
        if int(self.window) < 2:
            raise ValueError(f"`window` must be an int >= 2, got {self.window!r}.")
        _checks.check_number(self.k, "k", "a finite number > 0", lambda v: 0 < v < float("inf"))
        if self.min_history is None:
            object.__setattr__(self, "min_history", max(2, int(self.window) // 2))
        _checks.check_count(self.min_history, "min_history", static=True)
        if not 2 <= self.history <= int(self.window):
            raise ValueError(
                f"`min_history` must be an int in [2, window={self.window}], got "
                f"{self.min_history!r}."
            )

    @property
    def history(self) -> int:
        """`min_history` as an int (set by now)."""
        return int(self.min_history or 0)


class SpikeState(NamedTuple):
    """The spike test's state, inside :class:`GuardedState` (``state.spikes``)."""

    norms: jax.Array  # ring buffer of the last `window` recorded global norms
    losses: jax.Array  # the losses of the same steps (NaN where none was given)
    filled: jax.Array  # how many entries are recorded (<= window)
    next_index: jax.Array  # where the next step is recorded
    spike_count: jax.Array  # steps skipped as spikes so far
    norm_threshold: jax.Array  # the last step's largest norm that was not a spike (inf: none)
    loss_threshold: jax.Array  # the same for the loss (inf: no test)


def check(skip_spikes) -> SpikeSkip | None:
    """`guarded`'s `skip_spikes` argument: None, True (the defaults) or a `SpikeSkip`."""
    return _checks.check_settings(skip_spikes, "skip_spikes", SpikeSkip)


def init(config: SpikeSkip, dtype) -> SpikeState:
    size = int(config.window)
    return SpikeState(
        norms=jnp.zeros((size,), dtype),
        losses=jnp.full((size,), jnp.nan, dtype),
        filled=_steps.counter(),
        next_index=_steps.counter(),
        spike_count=_steps.counter(),
        norm_threshold=jnp.full((), jnp.inf, dtype),
        loss_threshold=jnp.full((), jnp.inf, dtype),
    )


def threshold(values, valid, k, min_history: int):
    """``mean + k * std`` of ``values[valid]`` (sample standard deviation, in two passes over
    the window), or inf with fewer than `min_history` valid entries."""
    n = jnp.sum(valid.astype(jnp.int32))
    count = jnp.maximum(n, 1).astype(values.dtype)
    mean = jnp.sum(jnp.where(valid, values, 0)) / count
    deviation = jnp.where(valid, values - mean, 0)
    var = jnp.sum(deviation * deviation) / jnp.maximum(count - 1, 1)
    limit = mean + _steps.as_dtype(k, values.dtype) * jnp.sqrt(var)
    return jnp.where(n >= min_history, limit, jnp.inf)


def judge(config: SpikeSkip, state: SpikeState, norm, loss):
    """``(spike, norm threshold, loss threshold)`` for this step, from the steps before it.
    `loss` is None when none was given."""
    dtype = state.norms.dtype
    recorded = jnp.arange(state.norms.shape[0]) < state.filled
    norm_limit = threshold(state.norms, recorded, config.k, config.history)
    spike = norm.astype(dtype) > norm_limit
    if loss is None:
        return spike, norm_limit, jnp.full((), jnp.inf, dtype)
    has_loss = recorded & jnp.isfinite(state.losses)
    loss_limit = threshold(state.losses, has_loss, config.k, config.history)
    return spike | (loss.astype(dtype) > loss_limit), norm_limit, loss_limit


def record(state: SpikeState, norm, loss, ok, spike, norm_limit, loss_limit) -> SpikeState:
    """The state after a step: its norm and loss recorded where `ok` (finite), the spike
    counted, the thresholds kept for logging."""
    dtype = state.norms.dtype
    size = state.norms.shape[0]
    index = state.next_index
    loss = jnp.full((), jnp.nan, dtype) if loss is None else loss.astype(dtype)
    return SpikeState(
        norms=jnp.where(ok, state.norms.at[index].set(norm.astype(dtype)), state.norms),
        losses=jnp.where(ok, state.losses.at[index].set(loss), state.losses),
        filled=jnp.where(ok, jnp.minimum(state.filled + 1, size), state.filled).astype(jnp.int32),
        next_index=jnp.where(ok, (index + 1) % size, index).astype(jnp.int32),
        spike_count=state.spike_count + spike.astype(jnp.int32),
        norm_threshold=norm_limit.astype(dtype),
        loss_threshold=loss_limit.astype(dtype),
    )
