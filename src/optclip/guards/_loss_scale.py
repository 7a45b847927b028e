"""Dynamic loss scaling: the scale, and its update rule (PyTorch's `GradScaler`, jmp's
`DynamicLossScale`, Keras' `LossScaleOptimizer`).

The scale itself is applied by :func:`optclip.guarded`, folded into the clip's factor."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip import _checks
from optclip.clips import _steps
from optclip.norms import _groups


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


def _plain(x):
    """The array in a Flax NNX Variable, or `x` itself."""
    if not _groups.is_variable(x):
        return x
    getter = getattr(x, "get_value", None)
    return getter() if callable(getter) else x.value


def _is_scaler(x) -> bool:
    return isinstance(x, LossScaleState)


def _scalers(opt_state) -> list:
    """The dynamic loss scales' states in `opt_state`; raises for one inside ``MultiSteps``."""
    is_node = lambda x: isinstance(x, (LossScaleState, optax.MultiStepsState))  # noqa: E731
    found = []
    for node in jax.tree.leaves(opt_state, is_leaf=is_node):
        if _is_scaler(node):
            found.append(node)
        elif isinstance(node, optax.MultiStepsState) and any(
            _is_scaler(x) for x in jax.tree.leaves(node.inner_opt_state, is_leaf=_is_scaler)
        ):
            raise ValueError(
                "`opt_state` holds a dynamic loss scale inside `optax.MultiSteps`, which cannot "
                "recover from an overflow: MultiSteps restarts its gradient sum as "
                "`(1 - emit) * sum`, and 0 * inf is NaN, so every later step overflows and the "
                "scale halves to its floor. Accumulate inside the guard instead: "
                "`optclip.guarded(optimizer, clip=..., loss_scale=..., accumulation_steps=k)`."
            )
    return found


def loss_scale(opt_state) -> jax.Array:
    """The current loss scale in an optimizer state: multiply the loss by it.

    Finds the state of :func:`guarded`'s dynamic loss scale anywhere in `opt_state`: on its own,
    in ``optax.chain``, ``optax.inject_hyperparams``, or a Flax NNX ``nnx.Optimizer``'s
    ``opt_state``. Inside or outside ``jit``; nothing is synced to the host.

    Args:
      opt_state: an optimizer state (any pytree) holding exactly one dynamic loss scale.

    Returns:
      A 0-d float32 array.

    Raises:
      ValueError: `opt_state` holds no dynamic loss scale, or more than one, or holds it inside
        ``optax.MultiSteps`` (a nesting that cannot recover from an overflow: use
        :func:`guarded`'s ``accumulation_steps``).

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optclip.guarded(optax.adam(1e-3), loss_scale=optclip.DynamicLossScale(2.**15))
      >>> print(optclip.loss_scale(opt.init(jnp.zeros(3))))
      32768.0
    """
    found = _scalers(opt_state)
    if len(found) != 1:
        what = "no dynamic loss scale" if not found else f"{len(found)} dynamic loss scales"
        raise ValueError(
            f"`opt_state` holds {what}; `loss_scale` reads the one of an optimizer built with "
            "`optclip.guarded(..., loss_scale=optclip.DynamicLossScale())`."
        )
    return jnp.asarray(_plain(found[0].loss_scale))
