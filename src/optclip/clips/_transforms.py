"""The clipping functions as `optax.GradientTransformation`s."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip import _checks, _warn
from optclip.clips import _functional, _nonfinite, _steps
from optclip.norms import _axes, _groups, _scale


class ScheduleState(NamedTuple):
    """State of a per-leaf norm clip whose threshold is an Optax schedule."""

    step: jax.Array  # updates so far: the schedule's step


class GlobalClipState(NamedTuple):
    """State of :func:`global_clip`; read a field with ``optax.tree.get(state, "global_norm")``,
    or every field of every clip in a chain with :func:`optclip.metrics`."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    clip_count: jax.Array  # updates so far that were scaled down
    nonfinite_count: jax.Array  # updates so far whose norm was not finite
    step: jax.Array  # updates so far (the step of a `max_norm` schedule)
    scale: jax.Array  # factor the last update was multiplied by (1 if not clipped; see `nonfinite`)
    threshold: jax.Array  # the last update's threshold, ``max(max_norm, 0)``
    group_norms: _groups.GroupNorms | None  # pre-clip norm of each group, or None


def _per_leaf_transform(clip_fn, max_norm, name="max_norm"):
    """A transform applying ``clip_fn(updates, threshold)``; state only for a schedule. `name`
    is the factory's argument, named by the error for a bad schedule value."""
    scheduled = _checks.is_schedule(max_norm)

    def init_fn(params):
        _checks.check_leaves(params, "`init`")
        return ScheduleState(_steps.counter()) if scheduled else optax.EmptyState()

    def step(updates, state, inverse_scale=None):
        threshold = _steps.threshold_at(max_norm, state.step, name) if scheduled else max_norm
        new_state = ScheduleState(optax.safe_increment(state.step)) if scheduled else state
        if inverse_scale is None:
            return clip_fn(updates, threshold), new_state
        # clip(g / s, c) = clip(g, c * s) / s: the norms read g as it comes (no unscaled copy).
        threshold = _scale.threshold_as(threshold, inverse_scale.dtype) / inverse_scale
        return _scale.scale_tree(clip_fn(updates, threshold), inverse_scale), new_state

    def update_fn(updates, state, params=None):
        del params
        return step(updates, state)

    def unscaling(updates, state, params, inverse_scale):
        del params
        return (*step(updates, state, inverse_scale), None)

    return _steps.register_unscaling(optax.GradientTransformation(init_fn, update_fn), unscaling)


@_checks.factory
def value_clip(clip_value_min, clip_value_max=_checks.NOT_GIVEN) -> optax.GradientTransformation:
    r"""Clamps every update element into ``[clip_value_min, clip_value_max]``.

    .. math::
        u_i \mapsto \min(\max(u_i, \text{min}), \text{max})

    Keras' ``clipvalue=v`` is ``value_clip(v)``: one argument clips into ``[-v, v]``
    (``optax.clip(v)``). With two arguments, each is a bound, and ``None`` is an open bound
    (no bound on that side), as in :func:`clip_by_value` and ``optax.tree.clip``:
    ``value_clip(lo, None)`` is a lower bound only, ``value_clip(None, hi)`` an upper bound only.
    ``value_clip(None)`` clips nothing.

    Args:
      clip_value_min: the lower bound, or ``None``; given alone, ``v`` means ``[-v, v]``.
      clip_value_max: the upper bound, or ``None`` for no upper bound. Left out, the range is
        ``[-v, v]`` with ``v`` = `clip_value_min`.

    Returns:
      An ``optax.GradientTransformation`` with empty state. A traced NaN bound
      (``optax.inject_hyperparams``) makes floating-point updates NaN.

    Raises:
      ValueError: concrete bounds with ``min > max`` (a single ``v < 0``), or a NaN bound.
      TypeError: a bound that is not a real number or array (a complex bound, say); at init and
        update, a non-numeric leaf (a str, a NumPy array of objects), named by its path.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.value_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([-3., 0.5, 2.]), tx.init(None))
      >>> print(updates)
      [-1.   0.5  1. ]
      >>> tx = optclip.value_clip(0.0, None)  # a lower bound only
      >>> print(tx.update(jnp.array([-3, 5]), tx.init(None))[0])
      [0 5]
    """
    if clip_value_max is _checks.NOT_GIVEN:
        clip_value_min, clip_value_max = _symmetric(clip_value_min)
    _checks.check_bounds(clip_value_min, clip_value_max)

    def init_fn(params):
        _checks.check_leaves(params, "`init`")
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return _functional.clip_by_value(updates, clip_value_min, clip_value_max), state

    return optax.GradientTransformation(init_fn, update_fn)


def _symmetric(v):
    """The bounds ``(-v, v)`` of the one-argument `value_clip(v)` (``(None, None)`` for None)."""
    if v is None:
        return None, None
    _checks.check_bounds(v, v)
    value = _checks.concrete(v)
    if value is not None and np.any(value < 0):
        raise ValueError(
            f"`clip_value_min` given alone means the range [-v, v] and must be >= 0, got {v!r}."
        )
    if isinstance(v, (np.ndarray, np.generic)) and np.issubdtype(v.dtype, np.unsignedinteger):
        v = v.astype(np.int64)  # (-v would wrap around)
    elif isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.unsignedinteger):
        v = v.astype(jnp.int32)
    return -v, v


@_checks.factory
def norm_clip(max_norm, axes=None) -> optax.GradientTransformation:
    r"""Clips every update leaf (or each slice along `axes`) to an L2 norm of at most `max_norm`.

    .. math::
        u \mapsto u \cdot \frac{c}{\max(\|u\|_2, c)} \quad \text{for each leaf } u

    Keras' ``clipnorm=c`` (per variable) and ``tf.clip_by_norm`` on every gradient. Clipping
    each tensor separately changes their relative scale; prefer :func:`global_clip`.

    Args:
      max_norm: the largest norm, a 0-d real number or an Optax schedule of the step count.
      axes: None (each whole leaf), an int or a sequence of ints; negative axes count from each
        leaf's last axis.

    Returns:
      An ``optax.GradientTransformation``; its state is empty (a step counter for a schedule).

    Raises:
      ValueError: `max_norm` is not 0-d or is NaN (a traced NaN makes the updates NaN); at
        update, a schedule value that is, or `axes` out of range for a leaf.
      TypeError: `axes` is not None, an int or ints (``[0.5]``, ``True``, a traced value); a
        non-numeric leaf (at init and update), an integer or boolean one (at update).

    Warns:
      UserWarning: a concrete `max_norm` <= 0, which zeroes every update (TensorFlow's rule;
        for Keras' "<= 0 turns clipping off", use :func:`clipped` with ``clipnorm=``).

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.norm_clip(1.0)
      >>> updates, _ = tx.update({"a": jnp.array([3., 4.]), "b": jnp.array([0.1])}, tx.init(None))
      >>> print(updates["a"], updates["b"])
      [0.6 0.8] [0.1]
    """
    _checks.check_threshold(max_norm, "max_norm")
    axes = _checks.check_axes(axes)
    _warn.warn_if_nonpositive(max_norm, f"norm_clip(max_norm={max_norm!r})", _warn.NO_CLIP_CLIPNORM)
    return _per_leaf_transform(
        lambda updates, threshold: _functional.clip_by_norm(updates, threshold, axes), max_norm
    )


@_checks.factory
def average_norm_clip(max_norm) -> optax.GradientTransformation:
    r"""Clips every update leaf to an average L2 norm (norm / size) of at most `max_norm`.

    .. math::
        u \mapsto u \cdot \frac{c}{\max(\|u\|_2 / n_u, c)}

    ``tf.clip_by_average_norm`` on every gradient.

    Args:
      max_norm: the largest average norm, a 0-d real number or an Optax schedule.

    Returns:
      An ``optax.GradientTransformation``; its state is empty (a step counter for a schedule).

    Raises:
      ValueError: `max_norm` is not 0-d or is NaN (a traced NaN makes the updates NaN); at
        update, a schedule value that is.
      TypeError: a non-numeric leaf (at init and update), an integer or boolean one (at update).

    Warns:
      UserWarning: a concrete `max_norm` <= 0, which zeroes every update.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.average_norm_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([3., 4.]), tx.init(None))
      >>> print(updates)
      [1.2 1.6]
    """
    _checks.check_threshold(max_norm, "max_norm")
    _warn.warn_if_nonpositive(max_norm, f"average_norm_clip(max_norm={max_norm!r})", _warn.NO_CLIP)
    return _per_leaf_transform(_functional.clip_by_average_norm, max_norm)


@_checks.factory
def block_rms_clip(threshold) -> optax.GradientTransformation:
    r"""Clips every update leaf to a root mean square (RMS) of at most `threshold`.

    .. math::
        u \mapsto u \cdot \frac{c}{\max(\|u\|_2 / \sqrt{n_u}, c)}

    ``optax.clip_by_block_rms`` with exact float32 accumulation, bit-for-bit identity under the
    threshold, TensorFlow's treatment of a negative threshold (zero) and no NaN at zero input;
    see :func:`clip_by_block_rms` for where it differs from optax.

    Args:
      threshold: the largest RMS, a 0-d real number (negative means zero), a traced value
        (``optax.inject_hyperparams``) or an Optax schedule of the step count.

    Returns:
      An ``optax.GradientTransformation``; its state is empty (a step counter for a schedule).

    Raises:
      ValueError: `threshold` is not 0-d or is NaN (a traced NaN makes the updates NaN); at
        update, a schedule value that is.
      TypeError: a non-numeric leaf (at init and update), an integer or boolean one (at update).

    Warns:
      UserWarning: a concrete `threshold` <= 0, which zeroes every update.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.block_rms_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([3., 4., 0., 0.]), tx.init(None))  # RMS 2.5
      >>> print(updates)
      [1.2 1.6 0.  0. ]
    """
    _checks.check_threshold(threshold, "threshold")
    _warn.warn_if_nonpositive(threshold, f"block_rms_clip(threshold={threshold!r})", _warn.NO_CLIP)
    return _per_leaf_transform(_functional.clip_by_block_rms, threshold, "threshold")


@_checks.factory
def global_clip(
    max_norm, *, ord=2, axis_name=None, nonfinite="propagate", group_norms=None, stacked=None
) -> optax.GradientTransformation:
    r"""Scales the whole update by one factor so that its global norm is at most `max_norm`.

    .. math::
        u \mapsto u \cdot \frac{c}{\max(\|u\|_p, c)}

    ``tf.clip_by_global_norm`` as an Optax transformation: Keras' ``global_clipnorm``,
    PyTorch's ``clip_grad_norm_`` (without its ``1e-6`` in the denominator, so the clipped norm
    is exactly `max_norm`), ``optax.clip_by_global_norm`` with exact float32 accumulation, the
    norm kept in the state for logging, multi-device reductions and non-finite handling.

    Args:
      max_norm: the largest global norm: a 0-d real number (negative means zero), a traced value
        (``optax.inject_hyperparams``), or an Optax schedule of the step count.
      ord: the norm's order: 2 (default), 1, ``inf`` or any ``p > 0``. With
        ``optax.inject_hyperparams``, pass ``static_args=("ord",)`` (a traced order works, but
        dispatches between the orders at run time).
      axis_name: inside ``shard_map``/``pmap``, the mesh axes the updates are split over; see
        :func:`global_norm`. None (default): inside ``shard_map`` each leaf's axes are read from
        how it varies over the mesh; elsewhere there is nothing to reduce (under ``jit``,
        sharded arrays are whole arrays). Under ``pmap``, gradients averaged with
        ``lax.pmean`` are the same on every device: leave None (naming the axis would count
        them once per device); :func:`check_split` checks it.
      nonfinite: what a non-finite norm does: ``"propagate"`` (default; every leaf becomes NaN,
        as in TensorFlow), ``"zero"`` (the update becomes zeros) or ``"raise"``
        (:class:`NonFiniteNormError` naming the leaves with NaN or inf, as PyTorch's
        ``error_if_nonfinite=True``; eager: before anything changes; under ``jit``: when the
        step runs, reported by JAX as its own runtime error, which :func:`reraise_errors`
        turns back into this one). Each such step is counted in ``nonfinite_count``.
      group_norms: also keep the pre-clip norm of groups of leaves (per layer, per leaf) in the
        state, computed from the same partial sums as the global norm: None (default), ``"leaf"``
        (one group per leaf), ``"layer"`` (one group per layer of the `stacked` leaves, every
        other leaf its own group), an int ``k >= 1`` (the leaves under each key path of depth
        ``k`` form a group; in a Flax ``{"params": ...}`` dict the depth counts the keys under
        ``"params"``), or a function of a leaf's key path returning its group's name (or None).
        Read them with ``state.group_norms["name"]`` or :func:`optclip.metrics`.
      stacked: the subtrees whose leaves stack the layers of a scanned model along a layer axis
        (``nn.scan``, ``nnx.vmap``, MaxText, Levanter): a key path (``"blocks"``,
        ``"decoder/layers"``; a Flax dict's lone ``"params"`` key may be left out), a list of
        key paths (layer axis 0), or a dict from key paths to layer axes
        (``{"decoder/layers": 1}``). Each such leaf is reduced over all axes but its layer axis
        (one partial sum per layer, in the same one read of the gradients), and layer ``i`` of
        the leaf at ``blocks/attn/w`` is named ``blocks/i/attn/w``, as in the unrolled model,
        for every `group_norms` spec. Given the same `stacked`, the global norm and the update
        are the same bits with or without `group_norms`. Inside ``shard_map``/``pmap`` a device
        may hold some of the layers: which mesh axes split the layer axis comes from
        `axis_name`'s ``PartitionSpec``\ s, or from the number of layers `init` saw (call it on
        the global parameters).

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`GlobalClipState` with
      ``global_norm`` (pre-clip norm of the last update), ``clip_count``, ``nonfinite_count``,
      ``step``, ``scale`` (the factor the last update was multiplied by: 1 if not clipped, NaN
      or 0 for a non-finite norm under ``"propagate"`` or ``"zero"``), ``threshold`` and
      ``group_norms`` (a :class:`GroupNorms`, or None).

    Raises:
      ValueError: `max_norm` is not 0-d or is NaN; unknown `ord`, `nonfinite` or
        `group_norms`; ``group_norms="layer"`` without `stacked`; at update, an `axis_name` that
        is not bound or does not match how the leaves vary over the mesh (:class:`AxisNameError`);
        at init and update, a `stacked` key path that holds no leaf, a leaf without the layer
        axis, or leaves of one stack with different numbers of layers (the message names them).
      TypeError: `axis_name` is not one of the accepted forms; `stacked` that is not a key path,
        list or dict, or a layer axis that is not an int; a non-numeric leaf (a str, a NumPy
        array of objects; at init and update), an integer or boolean leaf (at update), each named.
      NonFiniteNormError: with ``nonfinite="raise"``, a non-finite norm.

    Warns:
      UserWarning: a concrete `max_norm` <= 0, which zeroes every update (TensorFlow's rule;
        for Keras' "<= 0 turns clipping off", use :func:`clipped` with ``global_clipnorm=``).

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optax.chain(optclip.global_clip(6.5, group_norms="leaf"), optax.sgd(1.0))
      >>> params = {"b": jnp.zeros(1), "w": jnp.zeros(2)}
      >>> state = opt.init(params)
      >>> grads = {"b": jnp.array([12.]), "w": jnp.array([3., 4.])}
      >>> updates, state = opt.update(grads, state, params)
      >>> print(updates["w"], optax.tree.get(state, "global_norm"))
      [-1.5 -2. ] 13.0
      >>> print(state[0].group_norms["w"], state[0].group_norms["b"], state[0].scale)
      5.0 12.0 0.5

      A scanned model's blocks, stacked along axis 0, one norm per layer:

      >>> tx = optclip.global_clip(1.0, stacked="blocks", group_norms="layer")
      >>> grads = {"blocks": {"w": jnp.array([[3., 4.], [0., 1.], [6., 8.]])},
      ...          "head": jnp.array([2.])}
      >>> _, state = tx.update(grads, tx.init(grads))
      >>> print(list(state.group_norms), state.group_norms.values)
      ['blocks/0', 'blocks/1', 'blocks/2', 'head'] [ 5.  1. 10.  2.]

    References:
      Pascanu et al., 2013, On the difficulty of training recurrent neural networks,
      https://arxiv.org/abs/1211.5063
    """
    _checks.check_threshold(max_norm, "max_norm")
    p = _checks.check_ord(ord)
    _axes.check_axis_name(axis_name)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "raise"))
    group_norms = _groups.check_spec(group_norms)
    _warn.warn_if_nonpositive(
        max_norm, f"global_clip(max_norm={max_norm!r})", _warn.NO_CLIP_GLOBAL_CLIPNORM
    )
    stacked = _groups.check_stacked(stacked, group_norms)

    def init_fn(params):
        dtype = _steps.state_dtype(params)
        return GlobalClipState(
            global_norm=jnp.zeros((), dtype),
            clip_count=_steps.counter(),
            nonfinite_count=_steps.counter(),
            step=_steps.counter(),
            scale=jnp.ones((), dtype),
            threshold=_scale.threshold_as(_steps.threshold_at(max_norm, _steps.counter()), dtype),
            group_norms=_groups.init(group_norms, params, dtype, stacked, axis_name, "global_clip"),
        )

    def step(updates, state, inverse_scale=None):
        threshold = _steps.threshold_at(max_norm, state.step)
        norm, bucket_norms = _steps.clip_norms(
            updates,
            state.group_norms,
            group_norms,
            stacked,
            axis_name,
            "global_clip",
            inverse_scale,
            p=p,
        )
        updates, scale = _nonfinite.clip_to_threshold(
            updates, norm, threshold, nonfinite, "global_clip", inverse_scale
        )
        threshold = _scale.threshold_as(threshold, norm.dtype)
        finite = jnp.isfinite(norm)
        dtype = state.global_norm.dtype
        state = GlobalClipState(
            global_norm=norm.astype(dtype),
            clip_count=state.clip_count + (finite & (norm > threshold)).astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            step=optax.safe_increment(state.step),
            scale=scale.astype(dtype),
            threshold=threshold.astype(dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return updates, state

    return _steps.global_norm_transform(init_fn, step)
