"""The clipping functions as `optax.GradientTransformation`s, and Keras' optimizer arguments."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip import _checks, _functional, _norms


class ScheduleState(NamedTuple):
    """State of a per-leaf norm clip whose threshold is an Optax schedule."""

    count: jax.Array  # updates so far: the schedule's step


class GlobalClipState(NamedTuple):
    """State of :func:`global_clip`; read a field with ``optax.tree.get(state, "global_norm")``."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    clip_count: jax.Array  # updates so far that were scaled down
    nonfinite_count: jax.Array  # updates so far whose norm was not finite
    count: jax.Array  # updates so far (the step of a `max_norm` schedule)


class ClippedState(NamedTuple):
    """State of :func:`clipped`: the clip's, the wrapped optimizer's, and the skipped steps."""

    clip_state: optax.OptState
    inner_state: optax.OptState
    skip_count: jax.Array  # steps dropped because the gradient's norm was not finite


def counter():
    """A fresh int32 step or event counter."""
    return jnp.zeros((), jnp.int32)


def state_dtype(params):
    """The dtype of norms kept in a state: the accumulation dtype of the float leaves of
    `params` (float32, or float64 if any leaf is float64/complex128)."""
    leaves = [x for x in jax.tree.leaves(params) if _is_inexact(x)]
    return _norms.widest_accum_dtype([jnp.result_type(x) for x in leaves])


def clip_to_threshold(updates, norm, threshold, nonfinite: str):
    """`updates` (of global norm `norm`) scaled down to `threshold`, with the non-finite
    policy: "propagate" (NaN everywhere) or "zero"."""
    scale = _functional.clip_scale(norm, _functional.threshold_as(threshold, norm.dtype))
    updates = _functional.scale_tree(updates, scale)
    if nonfinite == "zero":
        updates = zero_unless(jnp.isfinite(norm), updates)
    return updates


def _check_axes_static(axes) -> None:
    if axes is None or _checks.is_traced(axes):
        return

    def is_int(a):
        if isinstance(a, (np.ndarray, jax.Array)):
            return a.ndim == 0 and jnp.issubdtype(a.dtype, jnp.integer)
        return isinstance(a, (numbers.Integral, np.integer)) and not isinstance(a, bool)

    try:
        ok = is_int(axes) or all(is_int(a) for a in axes)
    except TypeError:
        ok = False
    if not ok:
        raise TypeError(f"`axes` must be None, an int or a sequence of ints, got {axes!r}.")


def threshold_at(max_norm, count):
    """The threshold for this step: `max_norm` itself or the schedule's value at `count`."""
    if callable(max_norm) and not isinstance(max_norm, jax.Array):
        return _checks.check_scalar(max_norm(count), "max_norm(count)")
    return max_norm


def _per_leaf_transform(clip_fn, max_norm):
    """A transform applying ``clip_fn(updates, threshold)``; state only for a schedule."""
    scheduled = callable(max_norm) and not isinstance(max_norm, jax.Array)

    def init_fn(params):
        del params
        return ScheduleState(counter()) if scheduled else optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        if not scheduled:
            return clip_fn(updates, max_norm), state
        threshold = threshold_at(max_norm, state.count)
        return clip_fn(updates, threshold), ScheduleState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def value_clip(clip_value_min, clip_value_max=None) -> optax.GradientTransformation:
    r"""Clamps every update element into ``[clip_value_min, clip_value_max]``.

    .. math::
        u_i \mapsto \min(\max(u_i, \text{min}), \text{max})

    Keras' ``clipvalue=v`` is ``value_clip(v)``, which clips into ``[-v, v]``
    (``optax.clip(v)``). See :func:`clip_by_value`.

    Args:
      clip_value_min: the lower bound; given alone, ``v`` means ``[-v, v]``.
      clip_value_max: the upper bound.

    Returns:
      An ``optax.GradientTransformation`` with empty state.

    Raises:
      ValueError: concrete bounds with ``min > max`` (a single ``v < 0``).

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.value_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([-3., 0.5, 2.]), tx.init(None))
      >>> print(updates)
      [-1.   0.5  1. ]
    """
    if clip_value_max is None:
        _checks.check_bounds(clip_value_min, clip_value_min)
        value = _checks.concrete(clip_value_min)
        if value is not None and np.any(value < 0):
            raise ValueError(
                "`clip_value_min` given alone means the range [-v, v] and must be >= 0, "
                f"got {clip_value_min!r}."
            )
        clip_value_min, clip_value_max = -jnp.asarray(clip_value_min), clip_value_min
    _checks.check_bounds(clip_value_min, clip_value_max)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        return _functional.clip_by_value(updates, clip_value_min, clip_value_max), state

    return optax.GradientTransformation(init_fn, update_fn)


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
      ValueError: `max_norm` is not 0-d; at update, `axes` out of range for a leaf.
      TypeError: at update, an integer or boolean leaf.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.norm_clip(1.0)
      >>> updates, _ = tx.update({"a": jnp.array([3., 4.]), "b": jnp.array([0.1])}, tx.init(None))
      >>> print(updates["a"], updates["b"])
      [0.6 0.8] [0.1]
    """
    _checks.check_threshold(max_norm, "max_norm")
    _check_axes_static(axes)
    return _per_leaf_transform(
        lambda updates, threshold: _functional.clip_by_norm(updates, threshold, axes), max_norm
    )


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
      ValueError: `max_norm` is not 0-d.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.average_norm_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([3., 4.]), tx.init(None))
      >>> print(updates)
      [1.2 1.6]
    """
    _checks.check_threshold(max_norm, "max_norm")
    return _per_leaf_transform(_functional.clip_by_average_norm, max_norm)


def global_clip(
    max_norm, *, ord=2, axis_name=None, nonfinite="propagate"
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
      ord: the norm's order: 2 (default), 1, ``inf`` or any ``p > 0``.
      axis_name: mesh axes the updates are split over inside ``shard_map``/``pmap``; see
        :func:`global_norm`.
      nonfinite: ``"propagate"`` (default; a non-finite norm makes every leaf NaN, as in
        TensorFlow) or ``"zero"`` (the update becomes zeros). Both count the step in
        ``nonfinite_count``.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`GlobalClipState` with
      ``global_norm`` (pre-clip norm of the last update), ``clip_count``, ``nonfinite_count``
      and ``count``.

    Raises:
      ValueError: `max_norm` is not 0-d; unknown `ord` or `nonfinite`.
      TypeError: at update, an integer or boolean leaf (the message names its path).

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optax.chain(optclip.global_clip(1.0), optax.sgd(1.0))
      >>> params = {"w": jnp.zeros(2)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.array([3., 4.])}, state, params)
      >>> print(updates["w"], optax.tree.get(state, "global_norm"))
      [-0.6 -0.8] 5.0

    References:
      Pascanu et al., 2013, On the difficulty of training recurrent neural networks,
      https://arxiv.org/abs/1211.5063
    """
    _checks.check_threshold(max_norm, "max_norm")
    p = _checks.check_ord(ord)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero"))
    # An `axis_name` that is neither a name nor a tree is caught at the first update.

    def init_fn(params):
        dtype = state_dtype(params)
        return GlobalClipState(jnp.zeros((), dtype), counter(), counter(), counter())

    def update_fn(updates, state, params=None):
        del params
        threshold = threshold_at(max_norm, state.count)
        norm = _norms.global_norm_of(updates, p, axis_name, "global_clip")
        updates = clip_to_threshold(updates, norm, threshold, nonfinite)
        threshold = _functional.threshold_as(threshold, norm.dtype)
        finite = jnp.isfinite(norm)
        state = GlobalClipState(
            global_norm=norm.astype(state.global_norm.dtype),
            clip_count=state.clip_count + (finite & (norm > threshold)).astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            count=optax.safe_increment(state.count),
        )
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def zero_unless(ok, tree):
    """`tree` where `ok`, zeros of the same dtypes elsewhere."""
    return jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), tree)


def clipped(
    optimizer,
    *,
    clipnorm=None,
    clipvalue=None,
    global_clipnorm=None,
    nonfinite="propagate",
) -> optax.GradientTransformationExtraArgs:
    r"""Keras-style clipping arguments for any Optax optimizer: clip, then `optimizer`.

    ``keras.optimizers.Adam(1e-3, clipnorm=1.0)`` is ``clipped(optax.adam(1e-3), clipnorm=1.0)``:

    * ``clipnorm=c``: each gradient leaf clipped to norm ``c`` (:func:`norm_clip`);
    * ``clipvalue=v``: each element clipped into ``[-v, v]`` (:func:`value_clip`);
    * ``global_clipnorm=c``: all gradients scaled by one factor to global norm ``c``
      (:func:`global_clip`).

    Args:
      optimizer: the ``optax.GradientTransformation`` to wrap.
      clipnorm: see above; at most one of the three may be given.
      clipvalue: see above.
      global_clipnorm: see above.
      nonfinite: what to do when the gradient's global norm is not finite: ``"propagate"``
        (default; NaN reaches the update), ``"zero"`` (the clipped gradient becomes zeros before
        the optimizer sees it) or ``"skip"`` (the update is zeros and the optimizer's state is
        left exactly as it was: a skipped step). ``"zero"`` and ``"skip"`` count the step in
        ``skip_count``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`ClippedState`
      (``clip_state``, ``inner_state``, ``skip_count``).

    Raises:
      ValueError: more than one of `clipnorm`, `clipvalue`, `global_clipnorm`; an unknown
        `nonfinite`; a threshold that is not 0-d.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optclip.clipped(optax.sgd(1.0), global_clipnorm=1.0)
      >>> params = jnp.zeros(2)
      >>> updates, state = opt.update(jnp.array([3., 4.]), opt.init(params), params)
      >>> print(updates, optax.tree.get(state, "global_norm"))
      [-0.6 -0.8] 5.0
    """
    given = [
        name
        for name, value in (
            ("clipnorm", clipnorm),
            ("clipvalue", clipvalue),
            ("global_clipnorm", global_clipnorm),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            "`clipped` takes at most one of `clipnorm`, `clipvalue` and `global_clipnorm`, "
            f"got {', '.join(f'`{g}`' for g in given)}."
        )
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "skip"))
    if clipnorm is not None:
        clip = norm_clip(clipnorm)
    elif clipvalue is not None:
        clip = value_clip(clipvalue)
    elif global_clipnorm is not None:
        clip = global_clip(global_clipnorm)
    else:
        clip = optax.identity()
    inner = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        return ClippedState(clip.init(params), inner.init(params), counter())

    def update_fn(updates, state, params=None, **extra_args):
        if nonfinite != "propagate" and global_clipnorm is None:
            finite = jnp.isfinite(_norms.global_norm_of(updates, 2.0, None, "clipped"))
        clip_updates, clip_state = clip.update(updates, state.clip_state, params)
        if nonfinite != "propagate" and global_clipnorm is not None:
            finite = jnp.isfinite(clip_state.global_norm)
        if nonfinite == "zero":
            clip_updates = zero_unless(finite, clip_updates)
        new_updates, inner_state = inner.update(
            clip_updates, state.inner_state, params, **extra_args
        )
        skip_count = state.skip_count
        if nonfinite == "skip":
            new_updates = zero_unless(finite, new_updates)
            inner_state = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old), inner_state, state.inner_state
            )
        if nonfinite != "propagate":
            skip_count = skip_count + (~finite).astype(jnp.int32)
        return new_updates, ClippedState(clip_state, inner_state, skip_count)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
