"""Adaptive thresholds: unit-wise AGC, AutoClip's percentile and ZClip's z-score.

Each is an `optax.GradientTransformation` whose state is a NamedTuple of fixed-shape arrays with
the last pre-clip norm (`global_norm`) and the current threshold (`threshold`) for logging. The
norms come from `_norms` and the scaling from `_functional`, like every other clip.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec

from optclip import _axes, _checks, _functional, _groups, _norms, _transforms
from optclip._groups import GroupNorms


class AGCState(NamedTuple):
    """State of :func:`agc`; read a field with ``optax.tree.get(state, "global_norm")``."""

    global_norm: jax.Array  # pre-clip global L2 norm of the last update
    threshold: jax.Array  # sqrt(sum over units of (clipping * max(|W_u|, eps))**2)
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


class AutoClipState(NamedTuple):
    """State of :func:`autoclip`."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    threshold: jax.Array  # the percentile used for the last update (inf before the first)
    norms: jax.Array  # ring buffer of the last `history` finite norms, shape (history,)
    filled: jax.Array  # how many entries of `norms` are valid (<= history)
    next_index: jax.Array  # where the next norm is written
    clip_count: jax.Array  # updates so far that were scaled down
    nonfinite_count: jax.Array  # updates so far whose norm was not finite (not recorded)
    scale: jax.Array  # factor the last update was multiplied by
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


class ZClipState(NamedTuple):
    """State of :func:`zclip`."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    threshold: jax.Array  # largest norm the last update could have had and passed unchanged
    mean: jax.Array  # EMA of the norm (during warm-up: mean of the norms so far)
    var: jax.Array  # EMA of its variance (during warm-up: population variance so far)
    count: jax.Array  # finite norms seen so far (warm-up ends when it reaches `warmup_steps`)
    spike_count: jax.Array  # updates after warm-up flagged as spikes
    nonfinite_count: jax.Array  # updates so far whose norm was not finite (not recorded)
    scale: jax.Array  # factor the last update was multiplied by
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


# ----------------------------------------------------------------------------------------------
# Argument checks (concrete values only; traced ones from `inject_hyperparams` pass through).


def _check_number(value, name: str, accepted: str, ok) -> None:
    """A 0-d real number; if concrete, `ok(float(value))` must hold (NaN fails it, with the
    message saying what is accepted)."""
    _checks.check_scalar(value, name, allow_nan=True)
    concrete = _checks.concrete(value)
    if concrete is not None and not ok(float(concrete)):
        raise ValueError(f"`{name}` must be {accepted}, got {value!r}.")


def _check_count(value, name: str, static: bool) -> None:
    """A whole number >= 1. `static` ones set a shape and must be known when the factory runs."""
    if static and isinstance(value, jax.Array):
        raise TypeError(
            f"`{name}` sets the shape of the state and must be a Python int, got a JAX array "
            f"(with `optax.inject_hyperparams`, pass `static_args=('{name}',)`)."
        )
    if _checks.is_traced(value):
        if np.shape(value) != () or not jnp.issubdtype(value.dtype, jnp.integer):
            raise ValueError(
                f"`{name}` must be an int >= 1, got a traced {value.dtype} "
                f"array of shape {np.shape(value)}."
            )
        return
    concrete = _checks.concrete(value)
    if (
        isinstance(value, (bool, np.bool_))
        or concrete is None
        or concrete.shape != ()
        or not np.issubdtype(concrete.dtype, np.integer)
        or int(concrete) < 1
    ):
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")


def _as(value, dtype):
    """A (possibly traced, possibly bfloat16 from `inject_hyperparams`) scalar in `dtype`."""
    return jnp.asarray(value).astype(dtype)


# ----------------------------------------------------------------------------------------------
# AGC


def _unit_axes(shape: tuple, axis, path) -> tuple:
    """The axes a unit's norm is taken over: `optax.adaptive_grad_clip`'s rule.

    A tensor with at most one dimension of size > 1 is one unit (biases, scalars); 2-d and 3-d
    (dense ``(in, out)``, multi-head ``(in, heads, head_dim)``): axis 0; 4-d (conv HWIO): axes
    0-2; 5-d (conv DHWIO): axes 0-3; more dimensions (optax raises): all but the last.
    """
    ndim = len(shape)
    if axis is not None:
        return _checks.normalize_axes(axis, path, ndim)
    if sum(d != 1 for d in shape) <= 1:
        return tuple(range(ndim))
    if ndim in (2, 3):
        return (0,)
    return tuple(range(ndim - 1))


def _split_axes(spec, dims) -> tuple:
    """The mesh axes that `spec` splits dimensions `dims` of a leaf over."""
    if spec is None or not dims:
        return ()
    if not isinstance(spec, PartitionSpec):  # a name or names: the unit dimensions are split
        return _axes.spec_axes(spec)
    entries = [spec[d] if d < len(spec) else None for d in dims]
    return _axes.spec_axes(PartitionSpec(*entries))


def _global_shape(shape: tuple, spec) -> tuple:
    """A leaf's shape before `shard_map` split it by the `PartitionSpec` `spec`."""
    if not isinstance(spec, PartitionSpec):
        return shape
    return tuple(
        size * math.prod(lax.axis_size(a) for a in _split_axes(spec, (d,)))
        for d, size in enumerate(shape)
    )


def _agc_specs(paths_and_updates, updates, axis_name) -> list:
    """Each update leaf's part of `axis_name`, checked: its axes are bound and, inside
    `shard_map` with variation tracking, they are the axes the leaf varies over."""
    specs = _axes.leaf_specs(updates, axis_name)
    axes = [_axes.spec_axes(spec) for spec in specs]
    _axes.check_bound(sorted({a for leaf in axes for a in leaf}))
    if not _axes.tracks_variation():
        return specs
    for (path, g), declared in zip(paths_and_updates, axes):
        if axis_name is None and _axes.varying_axes(g):
            raise ValueError(
                f"`agc` inside `shard_map`: leaf `{_checks.leaf_name(path)}` varies over mesh "
                f"axes {sorted(_axes.varying_axes(g))}, so it is split, but `axis_name` is None. "
                "AGC's unit norms depend on which dimensions are split: pass the updates' "
                "PartitionSpecs (shard_map's `in_specs` for them) as `axis_name`."
            )
        _axes.check_declared(path, g, declared, "agc")
    return specs


def agc(
    clipping=0.01, eps=1e-3, *, axis=None, axis_name=None, group_norms=None
) -> optax.GradientTransformation:
    r"""Adaptive gradient clipping: each unit's update limited relative to its parameter's norm.

    .. math::
        G_u \mapsto G_u \cdot \frac{c_u}{\max(\|G_u\|_2, c_u)}, \quad
        c_u = \lambda \max(\|W_u\|_2, \epsilon)

    for every unit :math:`u` (an output unit: a column of a dense kernel, an output channel of a
    conv kernel; a whole bias or scalar), :math:`\lambda` = `clipping`. The same results as
    ``optax.adaptive_grad_clip(clipping, eps)``, whose rule for units it follows (see below), with
    norms accumulated in float32 (no float16 overflow) and the update left bit for bit unchanged
    where it is not clipped. It differs on purpose only where :math:`c_u < 10^{-6}`: optax then
    divides by ``max(norm, 1e-6)`` and clips below :math:`c_u`; here the unit's norm is exactly
    :math:`c_u`. A unit whose norm is not finite becomes NaN (other units are unaffected). No
    TensorFlow counterpart.

    Units, as in optax: a leaf with at most one dimension of size > 1 is one unit; 2-d and 3-d
    leaves (``(in, out)``, multi-head ``(in, heads, head_dim)``) reduce axis 0; 4-d (conv HWIO)
    axes 0-2; 5-d (conv DHWIO) axes 0-3; more dimensions (optax raises) all but the last. `axis`
    overrides this for every leaf.

    Args:
      clipping: :math:`\lambda`, the largest ratio of a unit's update norm to its parameter norm
        (0-d, >= 0; the paper uses 0.01 for batch 4096 and larger values for smaller batches).
      eps: :math:`\epsilon`, the floor on the parameter norm, so that zero-initialised units can
        move (0-d, >= 0).
      axis: None (the rule above), or an int or ints: the axes every leaf's units are reduced
        over (negative from each leaf's last axis), as optax's `axis`.
      axis_name: inside ``shard_map``/``pmap``, how the leaves are split, so that a unit split
        over devices gets its whole norm (all-reduced): a pytree of ``PartitionSpec`` s matching
        the updates (shard_map's ``in_specs`` for them), exact per dimension; or a mesh axis name
        or tuple of names, meaning every leaf's reduced (unit) dimensions are split over them. A
        leaf split only along its kept dimensions needs nothing. Not needed under ``jit`` with
        sharded arrays. `params` must be split like the updates. Inside ``shard_map``, each
        leaf's declared split is checked against how JAX says it varies over the mesh; a leaf
        that varies over mesh axes needs its ``PartitionSpec`` here (which dimensions are split
        decides the unit norms, and JAX does not track that).
      group_norms: also keep the pre-clip norm of groups of leaves in the state, from the unit
        norms (no second pass): as in :func:`optclip.global_clip`.

    Returns:
      An ``optax.GradientTransformation`` whose state is an :class:`AGCState`: ``global_norm``
      (pre-clip global L2 norm of the last update), ``threshold``, the global norm of the
      per-unit limits :math:`\sqrt{\sum_u c_u^2}`, which bounds the clipped update's norm, and
      ``group_norms`` (a :class:`optclip.GroupNorms`, or None).

    Raises:
      ValueError: a concrete negative or NaN `clipping` or `eps`, or one that is not 0-d; at
        update, ``params=None``, params that do not match the updates, or `axis` out of range.
      TypeError: at update, an integer or boolean leaf (the message names its path).

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.agc(clipping=0.1)
      >>> params = {"w": jnp.array([[3., 0.], [4., 1.]])}  # unit norms 5 and 1 (columns)
      >>> grads = {"w": jnp.array([[0., 0.2], [2., 0.]])}  # unit norms 2 and 0.2
      >>> updates, state = tx.update(grads, tx.init(params), params)
      >>> print(updates["w"])
      [[0.  0.1]
       [0.5 0. ]]
      >>> print(optax.tree.get(state, "global_norm"))
      2.0099752

    References:
      Brock et al., 2021, High-Performance Large-Scale Image Recognition Without Normalization,
      https://arxiv.org/abs/2102.06171
    """
    _check_number(clipping, "clipping", "a number >= 0", lambda v: v >= 0)
    _check_number(eps, "eps", "a number >= 0", lambda v: v >= 0)
    if axis is not None and not _checks.is_traced(axis):
        items = [axis] if isinstance(axis, (numbers.Integral, np.integer)) else axis
        try:
            ok = all(isinstance(a, (numbers.Integral, np.integer)) for a in items)
        except TypeError:
            ok = False
        if not ok or isinstance(axis, bool):
            raise TypeError(f"`axis` must be None, an int or a sequence of ints, got {axis!r}.")

    group_norms = _groups.check_spec(group_norms)

    def init_fn(params):
        dtype = _transforms.state_dtype(params)
        return AGCState(
            jnp.zeros((), dtype), jnp.zeros((), dtype), _groups.init(group_norms, params, dtype)
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "`agc` clips relative to the parameters: call `update(updates, state, params)` "
                "with `params`, got `params=None`."
            )
        paths_and_updates, treedef = jax.tree_util.tree_flatten_with_path(updates)
        param_leaves, param_treedef = jax.tree.flatten(params)
        if param_treedef != treedef:
            raise ValueError(
                "`agc` needs `params` with the same structure as the updates; got updates "
                f"{treedef} and params {param_treedef}."
            )
        specs = _agc_specs(paths_and_updates, updates, axis_name)
        out, unit_norms, unit_limits, kept_axes = [], [], [], []
        for (path, g), w, spec in zip(paths_and_updates, param_leaves, specs):
            _checks.check_float_leaf(path, g, "agc")
            _checks.check_float_leaf(path, w, "agc")
            g, w = jnp.asarray(g), jnp.asarray(w)
            if g.shape != w.shape:
                raise ValueError(
                    f"`agc` needs each update leaf to have its parameter's shape; leaf "
                    f"`{_checks.leaf_name(path)}` has update shape {g.shape} and parameter "
                    f"shape {w.shape}."
                )
            dims = _unit_axes(_global_shape(g.shape, spec), axis, path)
            mesh_axes = _split_axes(spec, dims)
            g_norm = _norms.all_reduce_norm(_norms.leaf_norm(g, 2.0, dims), mesh_axes)
            w_norm = _norms.all_reduce_norm(_norms.leaf_norm(w, 2.0, dims), mesh_axes)
            g_norm = g_norm.astype(state.global_norm.dtype)
            w_norm = w_norm.astype(state.global_norm.dtype)
            limit = _as(clipping, w_norm.dtype) * jnp.maximum(w_norm, _as(eps, w_norm.dtype))
            limit = _functional.threshold_as(limit, w_norm.dtype)
            out.append(_functional.apply_scale(g, _functional.clip_scale(g_norm, limit)))
            unit_norms.append(g_norm)
            unit_limits.append(jnp.broadcast_to(limit, g_norm.shape))
            kept = tuple(d for d in range(g.ndim) if d not in dims)
            kept_axes.append(_split_axes(spec, kept) if isinstance(spec, PartitionSpec) else ())
        # Every element lies in exactly one unit: the norm of the unit norms is the global norm
        # (and, bucket by bucket, each group's norm).
        buckets = _groups.buckets(group_norms, updates, state.group_norms, "agc")
        norm, bucket_norms = _norms.tree_norms(unit_norms, kept_axes, 2.0, buckets)
        state = AGCState(
            global_norm=norm.astype(state.global_norm.dtype),
            threshold=_norms.tree_norm(unit_limits, kept_axes, 2.0).astype(state.threshold.dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return jax.tree.unflatten(treedef, out), state

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------------------------
# AutoClip


def _percentile(values, filled, q):
    """NumPy's ``percentile(values[:filled], q)`` ('linear' method), traceable; inf if empty.

    Invalid entries are sorted to the end as +inf, and only indices below `filled` are read.
    """
    size = values.shape[0]
    valid = jnp.arange(size) < filled
    ordered = jnp.sort(jnp.where(valid, values, jnp.inf))
    position = _as(q, values.dtype) / 100 * (jnp.maximum(filled, 1) - 1).astype(values.dtype)
    position = jnp.clip(position, 0, jnp.maximum(filled - 1, 0).astype(values.dtype))
    low = jnp.floor(position).astype(jnp.int32)
    high = jnp.minimum(low + 1, jnp.maximum(filled - 1, 0))
    below, above = ordered[low], ordered[high]
    t = position - low.astype(values.dtype)
    # NumPy's lerp: from the nearer end, so that t == 1 gives `above` exactly.
    diff = above - below
    result = jnp.where(t >= 0.5, above - diff * (1 - t), below + diff * t)
    result = jnp.where(low == high, below, result)
    return jnp.where(filled > 0, result, jnp.inf)


def autoclip(
    percentile=10.0, history=1000, *, axis_name=None, nonfinite="propagate", group_norms=None
) -> optax.GradientTransformation:
    r"""AutoClip: a global clip at a percentile of the recent gradient norms.

    .. math::
        c_t = P_p\big(\{\|g_s\|_2 : t - H < s \le t\}\big), \qquad
        g_t \mapsto g_t \cdot \frac{c_t}{\max(\|g_t\|_2, c_t)}

    :math:`P_p` is the `percentile` :math:`p` with linear interpolation (NumPy's default
    ``'linear'`` method) over the last :math:`H` = `history` global norms, the current one
    included: before :math:`H` steps, over all of them. The paper keeps the whole history; a
    finite window lets the threshold follow a changing scale and keeps the state fixed-size.

    A non-finite norm is not recorded (the history is never poisoned) and is counted in
    ``nonfinite_count``; that update is NaN (`nonfinite="propagate"`) or zeros (``"zero"``).

    Args:
      percentile: :math:`p` in [0, 100] (default 10: the paper's best value for audio source
        separation; higher values clip less). May be traced (``optax.inject_hyperparams``).
      history: :math:`H`, how many recent norms are kept, an int >= 1. It sets the state's shape,
        so it is static: with ``optax.inject_hyperparams`` pass ``static_args=("history",)``.
      axis_name: mesh axes the updates are split over inside ``shard_map``/``pmap``; see
        :func:`optclip.global_norm`.
      nonfinite: ``"propagate"`` (default), ``"zero"`` or ``"raise"``, as in
        :func:`optclip.global_clip`.
      group_norms: also keep the pre-clip norm of groups of leaves in the state, as in
        :func:`optclip.global_clip`.

    Returns:
      An ``optax.GradientTransformation`` whose state is an :class:`AutoClipState`:
      ``global_norm`` (pre-clip norm of the last update), ``threshold`` (the percentile it was
      clipped to), ``norms`` (shape ``(history,)``), ``filled``, ``next_index``,
      ``clip_count``, ``nonfinite_count``, ``scale`` (the factor applied) and ``group_norms``.

    Raises:
      ValueError: `percentile` outside [0, 100] or not 0-d; `history` not an int >= 1; unknown
        `nonfinite`.
      TypeError: `history` is a JAX array (traced by ``inject_hyperparams``); at update, an
        integer or boolean leaf.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.autoclip(percentile=50.0, history=3)
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([3., 4.], [0., 1.], [0., 2.], [0., 10.]):
      ...     u, state = tx.update(jnp.array(g), state)
      >>> print(u, optax.tree.get(state, "threshold"))  # median of the norms 1, 2, 10
      [0. 2.] 2.0

    References:
      Seetharaman et al., 2020, AutoClip: Adaptive Gradient Clipping for Source Separation
      Networks, https://arxiv.org/abs/2007.14469
    """
    _check_number(percentile, "percentile", "a number in [0, 100]", lambda v: 0 <= v <= 100)
    _check_count(history, "history", static=True)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "raise"))
    group_norms = _groups.check_spec(group_norms)
    size = int(history)

    def init_fn(params):
        dtype = _transforms.state_dtype(params)
        return AutoClipState(
            global_norm=jnp.zeros((), dtype),
            threshold=jnp.full((), jnp.inf, dtype),
            norms=jnp.zeros((size,), dtype),
            filled=_transforms.counter(),
            next_index=_transforms.counter(),
            clip_count=_transforms.counter(),
            nonfinite_count=_transforms.counter(),
            scale=jnp.ones((), dtype),
            group_norms=_groups.init(group_norms, params, dtype),
        )

    def update_fn(updates, state, params=None):
        del params
        dtype = state.norms.dtype
        buckets = _groups.buckets(group_norms, updates, state.group_norms, "autoclip")
        norm, bucket_norms = _norms.norms_of(updates, 2.0, axis_name, "autoclip", buckets)
        norm = norm.astype(dtype)
        finite = jnp.isfinite(norm)
        norms = jnp.where(finite, state.norms.at[state.next_index].set(norm), state.norms)
        filled = jnp.where(finite, jnp.minimum(state.filled + 1, size), state.filled)
        next_index = jnp.where(finite, (state.next_index + 1) % size, state.next_index)
        threshold = _percentile(norms, filled, percentile)
        updates, scale = _transforms.clip_to_threshold(
            updates, norm, threshold, nonfinite, "autoclip"
        )
        new_state = AutoClipState(
            global_norm=norm,
            threshold=threshold,
            norms=norms,
            filled=filled.astype(jnp.int32),
            next_index=next_index.astype(jnp.int32),
            clip_count=state.clip_count + (finite & (norm > threshold)).astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            scale=scale.astype(dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------------------------
# ZClip


def zclip(
    alpha=0.97,
    z_thresh=2.5,
    max_norm=1.0,
    warmup_steps=25,
    mode="zscore",
    clip_option="adaptive_scaling",
    clip_factor=1.0,
    skip_update_on_spike=False,
    *,
    eps=1e-6,
    axis_name=None,
    nonfinite="propagate",
    group_norms=None,
) -> optax.GradientTransformation:
    r"""ZClip: a global clip when the norm is an outlier against its EMA mean and variance.

    After warm-up, with :math:`\mu, \sigma^2` the EMA statistics before step :math:`t` and
    :math:`n_t = \|g_t\|_2`:

    .. math::
        z_t = \frac{n_t - \mu}{\sigma + \epsilon}, \qquad
        \text{spike} \iff z_t > z_{thr}

    On a spike the norm is clipped to :math:`c_t`: ``mode="zscore"`` with
    ``clip_option="adaptive_scaling"``: :math:`c_t = (\mu + z_{thr}^2\,\sigma / z_t)\cdot`
    `clip_factor` (:math:`\mu + z_{thr}\sigma/\eta` with :math:`\eta = z_t/z_{thr}`: larger
    outliers are clipped harder); ``clip_option="mean"``: :math:`c_t = \mu`; ``mode="percentile"``
    (spike when :math:`n_t > \mu + z_{thr}\sigma`): :math:`c_t = \mu + z_{thr}\sigma`. Then the
    update is scaled to :math:`\min(c_t, \text{max\_norm})` (or to `max_norm` without a spike),
    and the statistics are updated, the variance with the already-updated mean, from
    :math:`x = c_t` on a spike (not the raw norm) and :math:`x = n_t` otherwise:

    .. math::
        \mu \leftarrow \alpha\mu + (1-\alpha)x, \qquad
        \sigma^2 \leftarrow \alpha\sigma^2 + (1-\alpha)(x - \mu)^2

    With `skip_update_on_spike`, a spike leaves the statistics unchanged. During the first
    `warmup_steps` finite norms the update is only clipped to `max_norm`, and then :math:`\mu`,
    :math:`\sigma^2` start as the mean and population variance of those norms. These are the
    rules and order of the reference implementation (``bluorion-com/ZClip``, ``zclip.py``), with
    two differences on purpose: the scale is ``c / n`` exactly (the reference divides by
    ``n + 1e-6``), and a non-finite norm changes no statistic and does not count towards the
    warm-up (the reference would poison its EMA); that update is NaN (`nonfinite="propagate"`)
    or zeros (``"zero"``) and is counted in ``nonfinite_count``.

    Args:
      alpha: EMA smoothing :math:`\alpha` in (0, 1) (default 0.97).
      z_thresh: :math:`z_{thr} > 0` (default 2.5).
      max_norm: an absolute cap on the norm, applied at every step, warm-up included (default
        1.0, as in the reference); ``None`` turns it off. Negative values mean zero. May be an
        Optax schedule of the step count (every update counts, non-finite ones included).
      warmup_steps: how many finite norms initialise the statistics, an int >= 1 (default 25).
      mode: ``"zscore"`` (default) or ``"percentile"``.
      clip_option: with ``mode="zscore"``: ``"adaptive_scaling"`` (default) or ``"mean"``;
        ignored with ``mode="percentile"``.
      clip_factor: multiplies the ``"adaptive_scaling"`` threshold, > 0 (default 1.0; the
        reference suggests 0.5-0.9 for more aggressive clipping).
      skip_update_on_spike: if True, spikes do not update the statistics (default False).
      eps: :math:`\epsilon > 0` in the z-score's denominator (default 1e-6, as in the reference).
      axis_name: mesh axes the updates are split over inside ``shard_map``/``pmap``; see
        :func:`optclip.global_norm`.
      nonfinite: ``"propagate"`` (default), ``"zero"`` or ``"raise"``, as in
        :func:`optclip.global_clip`.
      group_norms: also keep the pre-clip norm of groups of leaves in the state, as in
        :func:`optclip.global_clip`.

    Every numeric argument may be traced (``optax.inject_hyperparams``); the state's shape does
    not depend on any of them.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`ZClipState`: ``global_norm``
      (pre-clip norm of the last update); ``threshold``, the largest norm the last update could
      have had and passed unchanged (`max_norm` or inf during warm-up, then the spike boundary
      :math:`\mu + z_{thr}(\sigma + \epsilon)`, or :math:`\mu + z_{thr}\sigma` in percentile
      mode, capped at `max_norm`); ``mean``, ``var``, ``count``, ``spike_count``,
      ``nonfinite_count``, ``scale`` (the factor applied) and ``group_norms``.

    Raises:
      ValueError: `alpha` outside (0, 1); `z_thresh`, `clip_factor` or `eps` not > 0;
        `warmup_steps` not an int >= 1; unknown `mode`, `clip_option` or `nonfinite`; a number
        that is not 0-d.
      TypeError: `skip_update_on_spike` not a bool; at update, an integer or boolean leaf.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.zclip(warmup_steps=3, max_norm=None)
      >>> state = tx.init(jnp.zeros(1))
      >>> for g in (1.0, 1.2, 0.8, 1.1, 5.0):
      ...     u, state = tx.update(jnp.array([g]), state)
      >>> print(round(float(u[0]), 4), optax.tree.get(state, "spike_count"))  # 5.0 was a spike
      1.0439 1

    References:
      Kumar et al., 2025, ZClip: Adaptive Spike Mitigation for LLM Pre-Training,
      https://arxiv.org/abs/2504.02507 (reference implementation:
      https://github.com/bluorion-com/ZClip)
    """
    _check_number(alpha, "alpha", "a number in (0, 1)", lambda v: 0 < v < 1)
    _check_number(z_thresh, "z_thresh", "a number > 0", lambda v: v > 0)
    if max_norm is not None:
        _checks.check_threshold(max_norm, "max_norm")
    _check_count(warmup_steps, "warmup_steps", static=False)
    _checks.check_choice(mode, "mode", ("zscore", "percentile"))
    if mode == "zscore":
        _checks.check_choice(clip_option, "clip_option", ("adaptive_scaling", "mean"))
    _check_number(clip_factor, "clip_factor", "a number > 0", lambda v: v > 0)
    _checks.check_bool(skip_update_on_spike, "skip_update_on_spike")
    _check_number(eps, "eps", "a number > 0", lambda v: v > 0)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "raise"))
    group_norms = _groups.check_spec(group_norms)

    def cap_at(step, dtype):
        """The absolute cap at `step` (`max_norm`, its schedule's value, or inf)."""
        cap = jnp.inf if max_norm is None else _transforms.threshold_at(max_norm, step)
        return _functional.threshold_as(cap, dtype)

    def init_fn(params):
        dtype = _transforms.state_dtype(params)
        return ZClipState(
            global_norm=jnp.zeros((), dtype),
            threshold=cap_at(_transforms.counter(), dtype),
            mean=jnp.zeros((), dtype),
            var=jnp.zeros((), dtype),
            count=_transforms.counter(),
            spike_count=_transforms.counter(),
            nonfinite_count=_transforms.counter(),
            scale=jnp.ones((), dtype),
            group_norms=_groups.init(group_norms, params, dtype),
        )

    def update_fn(updates, state, params=None):
        del params
        dtype = state.mean.dtype
        buckets = _groups.buckets(group_norms, updates, state.group_norms, "zclip")
        norm, bucket_norms = _norms.norms_of(updates, 2.0, axis_name, "zclip", buckets)
        norm = norm.astype(dtype)
        finite = jnp.isfinite(norm)
        a, z_thr = _as(alpha, dtype), _as(z_thresh, dtype)
        # Steps so far: every update is counted in exactly one of the two.
        cap = cap_at(state.count + state.nonfinite_count, dtype)
        mean, var = state.mean, state.var
        warming = state.count < warmup_steps

        # After warm-up: the reference's `_compute_clip_val`, from the statistics before step t.
        std = jnp.sqrt(var)
        if mode == "percentile":
            boundary = mean + z_thr * std
            spike = norm > boundary
            clip_value = boundary
        else:
            z = (norm - mean) / (std + _as(eps, dtype))
            spike = z > z_thr
            boundary = mean + z_thr * (std + _as(eps, dtype))
            if clip_option == "mean":
                clip_value = mean
            else:
                eta = jnp.where(spike, z, z_thr) / z_thr  # >= 1: finite where not a spike
                clip_value = (mean + z_thr * std / eta) * _as(clip_factor, dtype)
        spike = spike & ~warming & finite
        target = jnp.where(warming, cap, jnp.minimum(jnp.where(spike, clip_value, norm), cap))

        # Statistics: Welford's running mean and population variance during warm-up (equal to
        # the reference's buffer), then the EMA fed with the clip value on a spike.
        k = (state.count + 1).astype(dtype)
        delta = norm - mean
        warm_mean = mean + delta / k
        warm_var = var + (delta * (norm - warm_mean) - var) / k
        x = jnp.where(spike, clip_value, norm)
        ema_mean = a * mean + (1 - a) * x
        ema_var = a * var + (1 - a) * jnp.square(x - ema_mean)
        if skip_update_on_spike:
            ema_mean = jnp.where(spike, mean, ema_mean)
            ema_var = jnp.where(spike, var, ema_var)
        new_mean = jnp.where(finite, jnp.where(warming, warm_mean, ema_mean), mean)
        new_var = jnp.where(finite, jnp.where(warming, warm_var, ema_var), var)

        updates, scale = _transforms.clip_to_threshold(updates, norm, target, nonfinite, "zclip")
        new_state = ZClipState(
            global_norm=norm,
            threshold=jnp.where(warming, cap, jnp.minimum(boundary, cap)),
            mean=new_mean,
            var=new_var,
            count=jnp.where(finite, optax.safe_increment(state.count), state.count),
            spike_count=state.spike_count + spike.astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            scale=scale.astype(dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
