"""The clipping functions as `optax.GradientTransformation`s, and Keras' optimizer arguments."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip import _checks, _functional, _groups, _norms
from optclip._groups import GroupNorms


class ScheduleState(NamedTuple):
    """State of a per-leaf norm clip whose threshold is an Optax schedule."""

    count: jax.Array  # updates so far: the schedule's step


class GlobalClipState(NamedTuple):
    """State of :func:`global_clip`; read a field with ``optax.tree.get(state, "global_norm")``,
    or every field of every clip in a chain with :func:`optclip.metrics`."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    clip_count: jax.Array  # updates so far that were scaled down
    nonfinite_count: jax.Array  # updates so far whose norm was not finite
    count: jax.Array  # updates so far (the step of a `max_norm` schedule)
    scale: jax.Array  # factor the last update was multiplied by (1 if not clipped; see `nonfinite`)
    threshold: jax.Array  # the last update's threshold, ``max(max_norm, 0)``
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


class NonFiniteNormError(FloatingPointError):
    """The norm of the updates is NaN or inf, and the clip was asked to raise
    (``nonfinite="raise"``, PyTorch's ``error_if_nonfinite=True``)."""


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


def raise_if_nonfinite(norm, tree, what: str) -> None:
    """Raises `NonFiniteNormError` naming the leaves with NaN or inf if `norm` is not finite.

    Eager: at once, before anything is updated. Under `jit`: from a host callback that only runs
    on a non-finite step (a `lax.cond` on the norm), so the step's results are never delivered;
    JAX re-raises it as its runtime error, with this message.
    """
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [_checks.leaf_name(path) for path, _ in paths_and_leaves]

    def report(norm_value, finite_leaves):
        norm_value = np.asarray(norm_value)
        if np.all(np.isfinite(norm_value)):
            return  # (a batched `cond` runs this branch for every example)
        bad = [name for name, ok in zip(names, finite_leaves) if not np.all(ok)]
        raise NonFiniteNormError(
            f"`{what}`: the norm of the updates is {norm_value}, not finite; leaves with NaN or "
            f"inf: {', '.join(f'`{b}`' for b in bad) or 'none (the norm itself overflowed)'}. "
            "(`nonfinite='raise'`; 'propagate' makes the update NaN, 'zero' drops it.)"
        )

    def finite_leaves():
        return [jnp.all(jnp.isfinite(leaf)) for _, leaf in paths_and_leaves]

    finite = jnp.all(jnp.isfinite(norm))
    if not _checks.is_traced(finite):
        if not bool(finite):
            report(norm, [bool(ok) for ok in finite_leaves()])
        return
    jax.lax.cond(finite, lambda: None, lambda: jax.debug.callback(report, norm, finite_leaves()))


def clip_to_threshold(updates, norm, threshold, nonfinite: str, what: str):
    """``(updates scaled down to `threshold`, the scale applied)`` for `updates` of global norm
    `norm`, with the non-finite policy: "propagate" (NaN everywhere), "zero" (zeros, scale 0) or
    "raise" (`raise_if_nonfinite`)."""
    if nonfinite == "raise":
        raise_if_nonfinite(norm, updates, what)
    scale = _functional.clip_scale(norm, _functional.threshold_as(threshold, norm.dtype))
    updates = _functional.scale_tree(updates, scale)
    if nonfinite == "zero":
        finite = jnp.isfinite(norm)
        updates = zero_unless(finite, updates)
        scale = jnp.where(finite, scale, 0)
    return updates, scale


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


def threshold_at(max_norm, count, name: str = "max_norm"):
    """The threshold for this step: `max_norm` itself or the schedule's value at `count` (`name`
    is the factory's argument, for the error on a bad schedule value)."""
    if _checks.is_schedule(max_norm):
        return _checks.check_scalar(max_norm(count), f"{name}(count)")
    return max_norm


def _per_leaf_transform(clip_fn, max_norm, name="max_norm"):
    """A transform applying ``clip_fn(updates, threshold)``; state only for a schedule.

    `name` is the factory's argument, named by the error for a bad schedule value.
    """
    scheduled = _checks.is_schedule(max_norm)

    def init_fn(params):
        del params
        return ScheduleState(counter()) if scheduled else optax.EmptyState()

    def update_fn(updates, state, params=None):
        del params
        if not scheduled:
            return clip_fn(updates, max_norm), state
        threshold = threshold_at(max_norm, state.count, name)
        return clip_fn(updates, threshold), ScheduleState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def value_clip(clip_value_min, clip_value_max=None) -> optax.GradientTransformation:
    r"""Clamps every update element into ``[clip_value_min, clip_value_max]``.

    .. math::
        u_i \mapsto \min(\max(u_i, \text{min}), \text{max})

    Keras' ``clipvalue=v`` is ``value_clip(v)``, which clips into ``[-v, v]``
    (``optax.clip(v)``). A bound may be ``None`` (no bound on that side, as in
    ``optax.tree.clip``): ``value_clip(None, hi)`` is an upper bound only. Since a single
    argument means ``[-v, v]``, a lower bound only is ``value_clip(lo, float("inf"))`` (integer
    leaves too: an infinite bound saturates at their range). ``value_clip(None)`` clips nothing.
    See :func:`clip_by_value`.

    Args:
      clip_value_min: the lower bound, or ``None``; given alone, ``v`` means ``[-v, v]``.
      clip_value_max: the upper bound, or ``None``: left out with a `clip_value_min` ``v``,
        the range is ``[-v, v]``.

    Returns:
      An ``optax.GradientTransformation`` with empty state. A traced NaN bound
      (``optax.inject_hyperparams``) makes floating-point updates NaN.

    Raises:
      ValueError: concrete bounds with ``min > max`` (a single ``v < 0``), or a NaN bound.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.value_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([-3., 0.5, 2.]), tx.init(None))
      >>> print(updates)
      [-1.   0.5  1. ]
      >>> tx = optclip.value_clip(0.0, float("inf"))  # a lower bound only
      >>> print(tx.update(jnp.array([-3, 5]), tx.init(None))[0])
      [0 5]
    """
    if clip_value_max is None and clip_value_min is not None:
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
      ValueError: `max_norm` is not 0-d or is NaN (a traced NaN makes the updates NaN); at
        update, a schedule value that is, or `axes` out of range for a leaf.
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
      ValueError: `max_norm` is not 0-d or is NaN (a traced NaN makes the updates NaN); at
        update, a schedule value that is.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.average_norm_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([3., 4.]), tx.init(None))
      >>> print(updates)
      [1.2 1.6]
    """
    _checks.check_threshold(max_norm, "max_norm")
    return _per_leaf_transform(_functional.clip_by_average_norm, max_norm)


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
      TypeError: at update, an integer or boolean leaf.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tx = optclip.block_rms_clip(1.0)
      >>> updates, _ = tx.update(jnp.array([3., 4., 0., 0.]), tx.init(None))  # RMS 2.5
      >>> print(updates)
      [1.2 1.6 0.  0. ]
    """
    _checks.check_threshold(threshold, "threshold")
    return _per_leaf_transform(_functional.clip_by_block_rms, threshold, "threshold")


def global_clip(
    max_norm, *, ord=2, axis_name=None, nonfinite="propagate", group_norms=None
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
        sharded arrays are whole arrays).
      nonfinite: what a non-finite norm does: ``"propagate"`` (default; every leaf becomes NaN,
        as in TensorFlow), ``"zero"`` (the update becomes zeros) or ``"raise"``
        (:class:`NonFiniteNormError` naming the leaves with NaN or inf, as PyTorch's
        ``error_if_nonfinite=True``; eager: before anything changes; under ``jit``: when the
        step runs, re-raised by JAX as its runtime error with this message). Each such step is
        counted in ``nonfinite_count``.
      group_norms: also keep the pre-clip norm of groups of leaves (per layer, per leaf) in the
        state, computed from the same partial sums as the global norm: None (default), ``"leaf"``
        (one group per leaf), an int ``k >= 1`` (the leaves under each key path of depth ``k``
        form a group), or a function of a leaf's key path returning its group's name (or None).
        Read them with ``state.group_norms["name"]`` or :func:`optclip.metrics`.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`GlobalClipState` with
      ``global_norm`` (pre-clip norm of the last update), ``clip_count``, ``nonfinite_count``,
      ``count``, ``scale`` (the factor the last update was multiplied by: 1 if not clipped, NaN
      or 0 for a non-finite norm under ``"propagate"`` or ``"zero"``), ``threshold`` and
      ``group_norms`` (a :class:`GroupNorms`, or None).

    Raises:
      ValueError: `max_norm` is not 0-d or is NaN; unknown `ord`, `nonfinite` or
        `group_norms`; at update, an `axis_name` that is not bound or does not match how the
        leaves vary over the mesh.
      TypeError: at update, an integer or boolean leaf (the message names its path).
      NonFiniteNormError: with ``nonfinite="raise"``, a non-finite norm.

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

    References:
      Pascanu et al., 2013, On the difficulty of training recurrent neural networks,
      https://arxiv.org/abs/1211.5063
    """
    _checks.check_threshold(max_norm, "max_norm")
    p = _checks.check_ord(ord)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "raise"))
    group_norms = _groups.check_spec(group_norms)
    # An `axis_name` that is neither a name nor a tree is caught at the first update.

    def init_fn(params):
        dtype = state_dtype(params)
        return GlobalClipState(
            global_norm=jnp.zeros((), dtype),
            clip_count=counter(),
            nonfinite_count=counter(),
            count=counter(),
            scale=jnp.ones((), dtype),
            threshold=_functional.threshold_as(threshold_at(max_norm, counter()), dtype),
            group_norms=_groups.init(group_norms, params, dtype),
        )

    def update_fn(updates, state, params=None):
        del params
        threshold = threshold_at(max_norm, state.count)
        buckets = _groups.buckets(group_norms, updates, state.group_norms, "global_clip")
        norm, bucket_norms = _norms.norms_of(updates, p, axis_name, "global_clip", buckets)
        updates, scale = clip_to_threshold(updates, norm, threshold, nonfinite, "global_clip")
        threshold = _functional.threshold_as(threshold, norm.dtype)
        finite = jnp.isfinite(norm)
        dtype = state.global_norm.dtype
        state = GlobalClipState(
            global_norm=norm.astype(dtype),
            clip_count=state.clip_count + (finite & (norm > threshold)).astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            count=optax.safe_increment(state.count),
            scale=scale.astype(dtype),
            threshold=threshold.astype(dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def zero_unless(ok, tree):
    """`tree` where `ok`, zeros of the same dtypes elsewhere."""
    return jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), tree)


def _check_optimizer(optimizer) -> None:
    """`clipped` wraps a transformation: not an optimizer's factory, nor anything else."""
    if (
        not isinstance(optimizer, type)
        and callable(getattr(optimizer, "init", None))
        and callable(getattr(optimizer, "update", None))
    ):
        return
    accepted = "an optax.GradientTransformation such as `optax.adam(1e-3)`"
    if callable(optimizer):
        kind = "class" if isinstance(optimizer, type) else "function"
        name = getattr(optimizer, "__name__", None) or repr(optimizer)
        raise TypeError(f"`optimizer` must be {accepted}; got the {kind} `{name}` (call it first).")
    raise TypeError(
        f"`optimizer` must be {accepted}; got {type(optimizer).__name__}: {optimizer!r}."
    )


def _keras_threshold(value):
    """Keras' rule for `clipped`: a threshold <= 0 turns the clip off (inf), concrete or traced,
    or a schedule's value; NaN stays NaN (so a traced NaN is never a silent "no clip")."""
    if _checks.is_schedule(value):
        return lambda count: _keras_threshold(value(count))
    known = _checks.concrete(value)
    if known is not None:
        return np.inf if known.shape == () and known <= 0 else value
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        value = value.astype(jnp.float32)
    return jnp.where(value <= 0, jnp.array(jnp.inf, value.dtype), value)


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

    As in Keras, a value ``<= 0`` turns the clip off (the gradient reaches `optimizer`
    unchanged), also when it is traced (``optax.inject_hyperparams``) or a schedule's value; the
    transformations themselves follow TensorFlow instead (a negative threshold is zero).

    Args:
      optimizer: the ``optax.GradientTransformation`` to wrap (``optax.adam(1e-3)``, not
        ``optax.adam``).
      clipnorm: see above; a 0-d number, traced value or schedule. At most one of the three may
        be given.
      clipvalue: see above; a 0-d number or traced value.
      global_clipnorm: see above; a 0-d number, traced value or schedule.
      nonfinite: what to do when the gradient's global norm is not finite: ``"propagate"``
        (default; NaN reaches the update), ``"zero"`` (the clipped gradient becomes zeros before
        the optimizer sees it), ``"skip"`` (the update is zeros and the optimizer's state is
        left exactly as it was: a skipped step) or ``"raise"`` (:class:`NonFiniteNormError`,
        as PyTorch's ``error_if_nonfinite=True``; see :func:`global_clip`). ``"zero"`` and
        ``"skip"`` count the step in ``skip_count``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`ClippedState`
      (``clip_state``, ``inner_state``, ``skip_count``).

    Raises:
      ValueError: more than one of `clipnorm`, `clipvalue`, `global_clipnorm`; an unknown
        `nonfinite`; a threshold that is not 0-d or is NaN (a traced NaN makes the update NaN).
      TypeError: `optimizer` is not a transformation (say, the factory ``optax.adam`` itself).
      NonFiniteNormError: with ``nonfinite="raise"``, a gradient whose norm is not finite.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optclip.clipped(optax.sgd(1.0), global_clipnorm=1.0)
      >>> params = jnp.zeros(2)
      >>> updates, state = opt.update(jnp.array([3., 4.]), opt.init(params), params)
      >>> print(updates, optax.tree.get(state, "global_norm"))
      [-0.6 -0.8] 5.0
    """
    _check_optimizer(optimizer)
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
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "skip", "raise"))
    if clipnorm is not None:
        clip = norm_clip(_keras_threshold(_checks.check_threshold(clipnorm, "clipnorm")))
    elif clipvalue is not None:
        clip = value_clip(_keras_threshold(_checks.check_scalar(clipvalue, "clipvalue")))
    elif global_clipnorm is not None:
        threshold = _checks.check_threshold(global_clipnorm, "global_clipnorm")
        clip = global_clip(
            _keras_threshold(threshold), nonfinite="raise" if nonfinite == "raise" else "propagate"
        )
    else:
        clip = optax.identity()
    inner = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        return ClippedState(clip.init(params), inner.init(params), counter())

    def update_fn(updates, state, params=None, **extra_args):
        if nonfinite != "propagate" and global_clipnorm is None:
            norm = _norms.global_norm_of(updates, 2.0, None, "clipped")
            if nonfinite == "raise":
                raise_if_nonfinite(norm, updates, "clipped")
            finite = jnp.isfinite(norm)
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
        if nonfinite in ("zero", "skip"):
            skip_count = skip_count + (~finite).astype(jnp.int32)
        return new_updates, ClippedState(clip_state, inner_state, skip_count)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
