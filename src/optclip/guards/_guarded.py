"""The guards of a large run around any Optax optimizer, from the clip's one read of the
gradients: dynamic loss scaling, a true skipped step on overflow, and skipping spikes."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip import _checks
from optclip.clips import _nonfinite, _steps
from optclip.clips._clipped import _check_optimizer
from optclip.guards import _accumulate, _loss_scale, _spikes
from optclip.guards._accumulate import AccumulationState
from optclip.guards._loss_scale import LossScaleState
from optclip.guards._spikes import SpikeState
from optclip.norms import _norms, _scale


class GuardedState(NamedTuple):
    """State of :func:`guarded`."""

    clip_state: optax.OptState  # the clip's (an empty state without a clip)
    inner_state: optax.OptState  # the wrapped optimizer's: unchanged by a skipped step
    global_norm: jax.Array  # global norm of the last step's gradients, unscaled, before clipping
    skipped: jax.Array  # whether the last step was skipped
    skip_count: jax.Array  # steps skipped so far, for any reason
    nonfinite_count: jax.Array  # steps so far whose gradients (or loss) were not finite
    step: jax.Array  # steps so far, skipped ones included
    scaler: LossScaleState | None  # the dynamic loss scale's state (`loss_scale=`), else None
    spikes: SpikeState | None  # the spike test's window and counts (`skip_spikes=`), else None
    nonfinite_streak: jax.Array  # non-finite steps in a row, up to the last (0 after a finite one)
    accumulation: AccumulationState | None  # the window's sums (`accumulation_steps=`), else None


def _clip(clip, updates, clip_state, params, inverse, axis_name):
    """``(clipped unscaled updates, clip state, unscaled global norm)``.

    optclip's clips take the loss-scaled gradients as they are and fold the inverse scale into
    their norms and their one factor (`_steps.register_unscaling`); the global norm is theirs
    when they compute it. Any other clip gets the unscaled gradients (which XLA may have to
    write out once), and the global norm is taken here: for per-leaf clips of big leaves XLA
    merges it with the clip's own reductions (the same sums of squares)."""
    folded = None if clip is None else _steps.unscaling_of(clip)
    norm = None
    if folded is not None:
        out, clip_state, norm = folded(updates, clip_state, params, inverse)
    else:
        out = updates if inverse is None else _scale.scale_tree(updates, inverse)
        if clip is not None:
            out, clip_state = clip.update(out, clip_state, params)
    if norm is None:
        norm = _norms.global_norm_of(updates, 2.0, axis_name, "guarded")
        if inverse is not None:
            norm = norm * inverse.astype(norm.dtype)
    return out, clip_state, norm


def _check_loss(value):
    """The loss given as ``value=``: None, or a 0-d real array."""
    if value is None:
        return None
    loss = jnp.asarray(value)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(
            "`value` (the loss, for the spike test) must be a 0-d float, got an array of "
            f"shape {loss.shape} and dtype {loss.dtype}; pass the mean loss of the step."
        )
    return loss


@_checks.factory
def guarded(
    optimizer,
    *,
    clip=None,
    loss_scale=None,
    skip_spikes=None,
    axis_name=None,
    accumulation_steps=None,
) -> optax.GradientTransformationExtraArgs:
    r"""Wraps `optimizer` with the guards of a large run: a clip, dynamic loss scaling, and
    skipped steps on overflow and on spikes, all from one read of the gradients.

    Each step, with :math:`s` the loss scale (1 without `loss_scale`) and :math:`g` the gradients
    of the loss times :math:`s`:

    .. math::
        u = \text{optimizer}\big(\text{clip}(g / s)\big), \qquad
        \text{skip} \iff \lnot\operatorname{finite}(\|g\|) \;\lor\; \text{spike}

    A skipped step returns zero updates and leaves the wrapped optimizer's state exactly as it
    was (bit for bit): the step did not happen, only the guards' counters moved. Non-finite
    gradients (an overflow) are always skipped, and lower the loss scale; a finite step counts
    towards growing it (:class:`DynamicLossScale`). A spike is a gradient norm, or a loss, more
    than ``k`` standard deviations above the mean of a rolling window (:class:`SpikeSkip`).

    The division by :math:`s` costs no pass over the gradients: optclip's clips
    (:func:`global_clip`, :func:`autoclip`, :func:`zclip`, :func:`norm_clip`,
    :func:`average_norm_clip`, :func:`block_rms_clip`) take :math:`g` as it is, divide their
    norms (scalars) by :math:`s`, and multiply each element once, by their factor times
    :math:`1/s`; the global norm that decides finiteness and spikes is theirs, or for a clip by
    parts (or none) the sum of the same per-leaf sums of squares. Any other transformation works
    too, on :math:`g/s`. This is PyTorch's ``GradScaler`` (``unscale_``, ``clip_grad_norm_``,
    ``step``, ``update``) or jmp's ``DynamicLossScale`` with ``optax.clip_by_global_norm``, and
    OLMo-core's ``SkipStepOptimizer``, in one transformation.

    Use it as any optimizer; multiply the loss by :func:`loss_scale` of the state before
    differentiating, and pass the loss itself (unscaled) as ``value=`` for the loss's spike
    test::

        scale = optclip.loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p) * scale)(params)
        updates, opt_state = opt.update(grads, opt_state, params, value=loss / scale)

    Pass the gradients in the master weights' dtype (float32: what ``jax.grad`` returns for
    float32 parameters cast to float16 inside the loss); every update keeps its gradient's dtype.

    Args:
      optimizer: the ``optax.GradientTransformation`` to wrap. Extra arguments of ``update``
        (``value=``) reach it.
      clip: an optax transformation applied to the unscaled gradients before `optimizer`, such
        as ``optclip.global_clip(1.0)``; None (default) for no clip.
      loss_scale: None (default: no loss scaling), True (the default
        :class:`DynamicLossScale`) or a :class:`DynamicLossScale`.
      skip_spikes: None (default: no spike test), True (the default :class:`SpikeSkip`) or a
        :class:`SpikeSkip`.
      axis_name: inside ``shard_map``/``pmap``, the mesh axes the gradients are split over, for
        the global norm taken here (when the clip does not take it); see :func:`global_norm`.
      accumulation_steps: None (default) or 1 for a step per call, or ``k > 1`` to accumulate
        gradients over ``k`` micro-batches (PyTorch's ``GradScaler`` rule): each call adds its
        micro-batch (and its ``value=``) to sums kept in the state and returns zero updates;
        the ``k``-th takes the step on their mean, with the clip acting on the mean gradient.
        The loss scale stays fixed within a window; a window holding an overflow is skipped as
        a whole, the scale backs off once, and the next window starts from zero sums. Growth
        counts windows. ``step``, ``skip_count`` and the other counters count windows too.
        Use this, not ``optax.MultiSteps`` around a loss-scaled ``guarded``: MultiSteps
        restarts its sum as ``0 * sum``, which stays NaN after an overflow
        (:func:`loss_scale` raises for that nesting).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`GuardedState`:
      ``clip_state``, ``inner_state``, ``global_norm`` (unscaled, before clipping), ``skipped``,
      ``skip_count``, ``nonfinite_count``, ``step``, ``scaler`` (a :class:`LossScaleState`:
      ``loss_scale``, ``growth_tracker``, ``overflow_count``), ``spikes`` (a
      :class:`SpikeState`), ``nonfinite_streak`` (non-finite steps in a row: a scale stuck at
      its floor shows here) and ``accumulation`` (an :class:`AccumulationState`: the window's
      sums and ``micro_step``). :func:`optclip.metrics` shows them all.

    Raises:
      TypeError: `optimizer` or `clip` is not a transformation; `loss_scale` or `skip_spikes`
        is not one of the accepted values; `accumulation_steps` is a JAX array; at init and
        update, a leaf of the parameters or gradients that is not a number (named by its path).
      ValueError: `accumulation_steps` is not an int >= 1.
      ValueError: at update, a ``value=`` that is not a 0-d float.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optclip.guarded(optax.sgd(1.0), clip=optclip.global_clip(1.0), loss_scale=True)
      >>> params = jnp.zeros(2)
      >>> state = opt.init(params)
      >>> print(optclip.loss_scale(state))
      65536.0
      >>> grads = optclip.loss_scale(state) * jnp.array([3., 4.])  # d(loss * scale) / dparams
      >>> updates, state = opt.update(grads, state, params)
      >>> print(updates, state.global_norm)
      [-0.6 -0.8] 5.0
      >>> updates, state = opt.update(jnp.array([jnp.inf, 0.]), state, params)  # an overflow
      >>> print(updates, state.skip_count, optclip.loss_scale(state))
      [0. 0.] 1 32768.0

    References:
      Micikevicius et al., 2018, Mixed Precision Training, https://arxiv.org/abs/1710.03740;
      Team OLMo, 2025, 2 OLMo 2 Furious, https://arxiv.org/abs/2501.00656 (skipping spikes).
    """
    _check_optimizer(optimizer)
    if clip is not None:
        _check_optimizer(clip, "clip", "optclip.global_clip(1.0)")
    guards = _Guards(
        clip=clip,
        inner=optax.with_extra_args_support(optimizer),
        scaling=_loss_scale.check(loss_scale),
        spiking=_spikes.check(skip_spikes),
        axis_name=axis_name,
        window=_accumulate.check(accumulation_steps),
    )
    branches = None if guards.window is None else _branches(guards)

    def init_fn(params):
        dtype = _steps.state_dtype(params)
        return GuardedState(
            clip_state=optax.EmptyState() if clip is None else clip.init(params),
            inner_state=guards.inner.init(params),
            global_norm=jnp.zeros((), dtype),
            skipped=jnp.zeros((), jnp.bool_),
            skip_count=_steps.counter(),
            nonfinite_count=_steps.counter(),
            step=_steps.counter(),
            scaler=None if guards.scaling is None else _loss_scale.init(guards.scaling),
            spikes=None if guards.spiking is None else _spikes.init(guards.spiking, dtype),
            nonfinite_streak=_steps.counter(),
            accumulation=None if guards.window is None else _accumulate.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        loss = _check_loss(extra_args.get("value"))
        if guards.window is None:
            return _step(guards, updates, updates, loss, state, params, extra_args)
        return _accumulated_step(guards, branches, updates, loss, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _Guards(NamedTuple):
    """What :func:`guarded` was built with, checked."""

    clip: optax.GradientTransformation | None
    inner: optax.GradientTransformationExtraArgs
    scaling: _loss_scale.DynamicLossScale | None
    spiking: _spikes.SpikeSkip | None
    axis_name: object
    window: int | None  # micro-batches a step (`accumulation_steps`), None for one


def _step(guards: _Guards, grads, like, loss, state, params, extra_args):
    """One guarded step on `grads` (the loss-scaled gradients, or with accumulation their sum
    over the window; `loss` likewise), its updates in the dtypes of `like`."""
    inverse = None
    if guards.scaling is not None:
        inverse = 1 / state.scaler.loss_scale
    if guards.window is not None:  # the window's mean: one more factor folded into the clip's
        mean = jnp.asarray(1 / guards.window, jnp.float32)
        inverse = mean if inverse is None else inverse * mean
    out, clip_state, norm = _clip(
        guards.clip, grads, state.clip_state, params, inverse, guards.axis_name
    )
    out = jax.tree.map(lambda o, g: o.astype(jnp.result_type(g)), out, like)
    finite = jnp.isfinite(norm)
    ok = finite if loss is None else finite & jnp.all(jnp.isfinite(loss))
    spike, spikes = jnp.zeros((), jnp.bool_), state.spikes
    if guards.spiking is not None:
        spike, norm_limit, loss_limit = _spikes.judge(guards.spiking, state.spikes, norm, loss)
        spike = spike & ok
        spikes = _spikes.record(state.spikes, norm, loss, ok, spike, norm_limit, loss_limit)
    skip = ~ok | spike
    new_updates, inner_state = guards.inner.update(out, state.inner_state, params, **extra_args)
    new_updates, inner_state = _nonfinite.skip_unless(
        ~skip, new_updates, inner_state, state.inner_state
    )
    scaler = state.scaler
    if guards.scaling is not None:
        scaler = _loss_scale.adjust(guards.scaling, state.scaler, finite)
    return new_updates, state._replace(
        clip_state=clip_state,
        inner_state=inner_state,
        global_norm=norm.astype(state.global_norm.dtype),
        skipped=skip,
        skip_count=state.skip_count + skip.astype(jnp.int32),
        nonfinite_count=state.nonfinite_count + (~ok).astype(jnp.int32),
        step=optax.safe_increment(state.step),
        scaler=scaler,
        spikes=spikes,
        nonfinite_streak=jnp.where(ok, 0, optax.safe_increment(state.nonfinite_streak)),
    )


# What can be an operand of the accumulation's `cond`: arrays (other values are closed over)
_OPERANDS = (jax.Array, np.ndarray, np.generic)


def _accumulated_step(guards: _Guards, branches, updates, loss, state, params, extra_args):
    """A micro-batch: added to the window's sums; on the window's last one, the step on their
    mean (the loss's too), and the sums restarted. Every other micro-batch returns zero updates
    and leaves the rest of the state as it was.

    `branches` are the ``cond``'s two (`_branches`), made once by :func:`guarded`, and the
    call's values are their operands, not closed over: JAX keeps what it traced by the function
    and its operands' types, so an eager call runs the ``cond`` compiled by the first call with
    the same types. Branches made in each call would be new functions: traced, and the whole
    step compiled, anew at every eager micro-batch. Extra arguments of ``update`` that are not
    arrays cannot be operands: with them the branches are made for the call (and compiled)."""
    sums = _accumulate.add(state.accumulation, updates, loss)
    args = extra_args
    if loss is not None:  # (`value=`: the branches pass on the window's mean loss instead)
        args = {name: x for name, x in extra_args.items() if name != "value"}
    if not all(isinstance(x, _OPERANDS) for x in jax.tree.leaves(args)):
        branches, args = _branches(guards, fixed_args=args), None
    emit, hold = branches
    pred = sums.micro_step == guards.window
    return jax.lax.cond(pred, emit, hold, sums, updates, loss, state, params, args)


def _branches(guards: _Guards, fixed_args=None):
    """The accumulation ``cond``'s branches ``(emit, hold)``: the step on the window's mean,
    and holding (zero updates). Both take ``(sums, updates, loss, state, params, args)``, with
    `args` the extra arguments of ``update`` but ``value=``; with `fixed_args` given (extra
    arguments that are not arrays), they use it instead."""
    k = guards.window

    def emit(sums, updates, loss, state, params, args):
        if fixed_args is not None:
            args = fixed_args
        mean_loss = None
        if loss is not None:
            mean_loss = sums.loss_sum / k
            args = {**args, "value": mean_loss}
        new_updates, new_state = _step(guards, sums.grads, updates, mean_loss, state, params, args)
        return new_updates, new_state._replace(accumulation=_accumulate.restart(sums))

    def hold(sums, updates, loss, state, params, args):
        shapes = jax.eval_shape(emit, sums, updates, loss, state, params, args)[0]
        return _zeros(shapes, updates), state._replace(accumulation=sums)

    return emit, hold


def _zeros(shapes, grads):
    """Zeros of `shapes` (the step's updates), made from the gradients where their structures
    and shapes match: inside ``shard_map`` they then vary over the same mesh axes as the
    updates, as both branches of a ``cond`` must."""

    def zeros(s, g=None):
        if g is not None and jnp.shape(g) == s.shape:
            return jnp.zeros_like(g, s.dtype)
        return jnp.zeros(s.shape, s.dtype)

    try:
        return jax.tree.map(zeros, shapes, grads)
    except (ValueError, TypeError):  # (another structure than the gradients')
        return jax.tree.map(zeros, shapes)
