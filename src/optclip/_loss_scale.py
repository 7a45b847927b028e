"""Dynamic loss scaling: the scale, and its update rule (PyTorch's `GradScaler`, jmp's
`DynamicLossScale`, Keras' `LossScaleOptimizer`).

The scale itself is applied by :func:`optclip.guarded`, folded into the clip's factor."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from optclip import _checks, _steps


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    r"""Settings of a dynamic loss scale, for :func:`optclip.guarded`'s `loss_scale`.

    The loss is multiplied by the scale :math:`s` before differentiating (read it with
    :func:`optclip.loss_scale`), so that small float16 gradients do not flush to zero; the
    gradients are divided by :math:`s` again inside the clip. After every step:

    .. math::
        s \leftarrow \begin{cases}
          \max(s \cdot \text{backoff\_factor},\ \text{min\_scale}) &
            \text{the gradients overflowed (inf or NaN): the step is skipped} \\
          s \cdot \text{growth\_factor} & \text{the growth\_interval-th finite step in a row} \\
          s & \text{otherwise}
        \end{cases}

    and the count of finite steps in a row restarts from zero after either change. A growth
    that would make :math:`s` infinite is not applied (the count still restarts).

    This is the rule, step for step, of PyTorch's ``torch.amp.GradScaler`` (``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``: the same names and defaults; it
    has no lower bound, ``min_scale=0`` here), of jmp's ``DynamicLossScale`` (``loss_scale``,
    ``factor`` for both growth and backoff, ``period``, ``min_loss_scale=1``) and of Keras'
    ``LossScaleOptimizer`` (``initial_scale=2**15``, factor 2, ``dynamic_growth_steps``; TF
    Keras bounds the scale below by 1). Flax's ``DynamicScale`` uses the same names but grows
    one step later (on the finite step after `growth_interval` finite steps).

    Args:
      init_scale: the first scale, a finite number > 0 (default ``2**16``, PyTorch's and
        Flax's).
      growth_factor: the scale's factor after `growth_interval` finite steps in a row, >= 1
        (default 2).
      backoff_factor: the scale's factor after an overflow, in (0, 1] (default 0.5).
      growth_interval: finite steps in a row before the scale grows, an int >= 1 (default 2000).
      min_scale: the scale never backs off below this, >= 0 (default 1, as in jmp and TF Keras:
        below 1 the loss scale no longer helps; 0 is PyTorch's unbounded rule).

    Raises:
      ValueError: a value outside its range, or not 0-d.

    Examples:
      >>> import optclip
      >>> optclip.DynamicLossScale(growth_interval=1000)
      DynamicLossScale(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000, min_scale=1.0)
    """  # noqa: E501 - the doctest's output is one line

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0

    def __post_init__(self):
        finite_positive = "a finite number > 0"
        _checks.check_number(
            self.init_scale, "init_scale", finite_positive, lambda v: 0 < v < float("inf")
        )
        _checks.check_number(
            self.growth_factor, "growth_factor", "a finite number >= 1", lambda v: 1 <= v < 1e300
        )
        _checks.check_number(
            self.backoff_factor, "backoff_factor", "a number in (0, 1]", lambda v: 0 < v <= 1
        )
        _checks.check_count(self.growth_interval, "growth_interval", static=True)
        _checks.check_number(
            self.min_scale, "min_scale", "a finite number >= 0", lambda v: 0 <= v < float("inf")
        )
        if float(self.min_scale) > float(self.init_scale):
            raise ValueError(
                f"`min_scale` must be <= `init_scale`, got min_scale={self.min_scale!r} > "
                f"init_scale={self.init_scale!r}."
            )


class LossScaleState(NamedTuple):
    """The dynamic loss scale's state, inside :class:`GuardedState` (``state.scaler``)."""

    loss_scale: jax.Array  # float32: multiply the loss by it (`optclip.loss_scale(state)`)
    growth_tracker: jax.Array  # finite steps in a row since the scale last changed
    overflow_count: jax.Array  # steps so far whose gradients overflowed (inf or NaN)


def check(loss_scale) -> DynamicLossScale | None:
    """`guarded`'s `loss_scale` argument: None, True (the defaults) or a `DynamicLossScale`."""
    return _checks.check_settings(loss_scale, "loss_scale", DynamicLossScale)


def init(config: DynamicLossScale) -> LossScaleState:
    return LossScaleState(
        loss_scale=jnp.asarray(config.init_scale, jnp.float32),
        growth_tracker=_steps.counter(),
        overflow_count=_steps.counter(),
    )


def adjust(config: DynamicLossScale, state: LossScaleState, finite) -> LossScaleState:
    """The state after a step whose gradients were all finite (`finite`) or not."""
    scale = state.loss_scale
    in_a_row = state.growth_tracker + 1
    grow = finite & (in_a_row >= config.growth_interval)
    grown = scale * _steps.as_dtype(config.growth_factor, scale.dtype)
    grown = jnp.where(jnp.isfinite(grown), grown, scale)  # never grow to inf
    backed_off = jnp.maximum(
        scale * _steps.as_dtype(config.backoff_factor, scale.dtype),
        _steps.as_dtype(config.min_scale, scale.dtype),
    )
    return LossScaleState(
        loss_scale=jnp.where(finite, jnp.where(grow, grown, scale), backed_off),
        growth_tracker=jnp.where(finite & ~grow, in_a_row, 0).astype(jnp.int32),
        overflow_count=state.overflow_count + (~finite).astype(jnp.int32),
    )
