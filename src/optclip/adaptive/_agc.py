"""Adaptive gradient clipping (AGC, Brock et al. 2021): each unit's update limited relative to
its parameter's norm, with the unit norms all-reduced where a unit is split over devices."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec

from optclip import _checks, _warn
from optclip.clips import _steps
from optclip.norms import _axes, _groups, _layers, _norms, _scale
from optclip.norms._groups import GroupNorms


class AGCState(NamedTuple):
    """State of :func:`agc`; read a field with ``optax.tree.get(state, "global_norm")``."""

    global_norm: jax.Array  # pre-clip global L2 norm of the last update
    threshold: jax.Array  # sqrt(sum over units of (clipping * max(|W_u|, eps))**2)
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


def _unit_axes(shape: tuple, axis, path) -> tuple:
    """The axes a unit's norm is taken over: `optax.adaptive_grad_clip`'s rule.

    A tensor with at most one dimension of size > 1 is one unit (biases, scalars); 2-d and 3-d
    (dense ``(in, out)``, multi-head ``(in, heads, head_dim)``): axis 0; 4-d (conv HWIO): axes
    0-2; 5-d (conv DHWIO): axes 0-3; more dimensions (optax raises): all but the last.
    """
    ndim = len(shape)
    if axis is not None:
        return _checks.normalize_axes(axis, path, ndim, "axis")
    if sum(d != 1 for d in shape) <= 1:
        return tuple(range(ndim))
    if ndim in (2, 3):
        return (0,)
    return tuple(range(ndim - 1))


def _layer_unit_axes(shape: tuple, axis, path, stack) -> tuple:
    """`_unit_axes` of a leaf; for a leaf that stacks layers (`stack`), those of each layer's
    slice, so that its units are the unrolled model's (the layer axis is never reduced)."""
    if stack is None:
        return _unit_axes(shape, axis, path)
    inner = _unit_axes(shape[: stack.axis] + shape[stack.axis + 1 :], axis, path)
    return tuple(d + (d >= stack.axis) for d in inner)


def _unit_norm(x, dims):
    """The 2-norm of each unit of `x` (over `dims`). A unit whose squares sum to exactly zero
    is trusted to be zero (`_norms.leaf_norm`'s `zero_is_exact`): zero-initialised layers must
    not send every step down the rescaled path, and the clip cannot tell 0 from ~1e-19 anyway,
    since its threshold is ``clipping * max(weight norm, eps)``."""
    return _norms.leaf_norm(x, 2.0, dims, zero_is_exact=True)


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


def _flatten_with_params(updates, params):
    """``(paths and leaves of the updates, their structure, the parameters' leaves)``, checked:
    `params` given, with the structure of the updates."""
    if params is None:
        raise ValueError(
            "`agc` clips relative to the parameters: call `update(updates, state, params)` "
            "with `params`, got `params=None`."
        )
    paths_and_updates, treedef = jax.tree_util.tree_flatten_with_path(updates)
    param_leaves, param_treedef = jax.tree.flatten(params)
    structure: Any = param_treedef  # (mypy cannot resolve jaxlib's PyTreeDef)
    if structure != treedef:
        raise ValueError(
            "`agc` needs `params` with the same structure as the updates; got updates "
            f"{treedef} and params {param_treedef}."
        )
    return paths_and_updates, treedef, param_leaves


@_checks.factory
def agc(
    clipping=0.01, eps=1e-3, *, axis=None, axis_name=None, group_norms=None, stacked=None
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
      stacked: the subtrees whose leaves stack layers, as in :func:`optclip.global_clip`. A
        stacked leaf's units are those of each layer's slice (the unrolled model's: the rule
        above and `axis` apply to the slice), where optax's rule would take a
        ``(layers, in, out)`` kernel for a multi-head one and mix the layers in each unit.

    Returns:
      An ``optax.GradientTransformation`` whose state is an :class:`AGCState`: ``global_norm``
      (pre-clip global L2 norm of the last update), ``threshold``, the global norm of the
      per-unit limits :math:`\sqrt{\sum_u c_u^2}`, which bounds the clipped update's norm, and
      ``group_norms`` (a :class:`optclip.GroupNorms`, or None).

    Raises:
      ValueError: a concrete negative or NaN `clipping` or `eps`, or one that is not 0-d; at
        update, ``params=None``, params that do not match the updates, or `axis` out of range;
        a `group_norms` or `stacked` that does not fit (as in :func:`optclip.global_clip`).
      TypeError: `axis` is not None, an int or ints; `axis_name` is not one of the accepted
        forms; a non-numeric leaf (a str, a NumPy array of objects) of `params` at init, of the
        updates or `params` at update; at update, an integer or boolean leaf (each named by its
        path).

    Warns:
      UserWarning: a concrete ``clipping=0``, which zeroes every update.

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
    _checks.check_number(clipping, "clipping", "a number >= 0", lambda v: v >= 0)
    _checks.check_number(eps, "eps", "a number >= 0", lambda v: v >= 0)
    axis = _checks.check_axes(axis, "axis")
    _axes.check_axis_name(axis_name)
    _warn.warn_if_nonpositive(
        clipping,
        f"agc(clipping={clipping!r})",
        "If you meant no clipping, leave the clip out.",
        "each unit's update is limited to `clipping` times its parameter's norm.",
    )

    group_norms = _groups.check_spec(group_norms)
    stacked = _groups.check_stacked(stacked, group_norms)

    def init_fn(params):
        dtype = _steps.state_dtype(params)
        return AGCState(
            jnp.zeros((), dtype),
            jnp.zeros((), dtype),
            _groups.init(group_norms, params, dtype, stacked, axis_name, "agc"),
        )

    def step(updates, state, params, inverse_scale=None):
        paths_and_updates, treedef, param_leaves = _flatten_with_params(updates, params)
        for (path, g), w in zip(paths_and_updates, param_leaves):  # (before shapes are read)
            _checks.check_float_leaf(path, g, "agc")
            _checks.check_float_leaf(path, w, "agc")
        specs = _agc_specs(paths_and_updates, updates, axis_name)
        leaf_stacks = _layers.stacks(stacked, updates)
        out, unit_norms, unit_limits, kept_axes = [], [], [], []
        for (path, g), w, spec, stack in zip(paths_and_updates, param_leaves, specs, leaf_stacks):
            g, w = jnp.asarray(g), jnp.asarray(w)
            if g.shape != w.shape:
                raise ValueError(
                    f"`agc` needs each update leaf to have its parameter's shape; leaf "
                    f"`{_checks.leaf_name(path)}` has update shape {g.shape} and parameter "
                    f"shape {w.shape}."
                )
            dims = _layer_unit_axes(_global_shape(g.shape, spec), axis, path, stack)
            mesh_axes = _split_axes(spec, dims)
            g_norm = _norms.all_reduce_norm(_unit_norm(g, dims), mesh_axes)
            w_norm = _norms.all_reduce_norm(_unit_norm(w, dims), mesh_axes)
            if inverse_scale is not None:  # loss-scaled gradients: the unscaled unit norms
                g_norm = g_norm * inverse_scale.astype(g_norm.dtype)
            g_norm = g_norm.astype(state.global_norm.dtype)
            w_norm = w_norm.astype(state.global_norm.dtype)
            limit = _steps.as_dtype(clipping, w_norm.dtype) * jnp.maximum(
                w_norm, _steps.as_dtype(eps, w_norm.dtype)
            )
            limit = _scale.threshold_as(limit, w_norm.dtype)
            factor = _scale.clip_scale(g_norm, limit)
            if inverse_scale is not None:
                factor = factor * inverse_scale.astype(factor.dtype)
            out.append(_scale.apply_scale(g, factor))
            unit_norms.append(g_norm)
            unit_limits.append(jnp.broadcast_to(limit, g_norm.shape))
            kept = tuple(d for d in range(g.ndim) if d not in dims)
            kept_axes.append(_split_axes(spec, kept) if isinstance(spec, PartitionSpec) else ())
        # Every element lies in exactly one unit: the norm of the unit norms is the global norm
        # (and, bucket by bucket, each group's norm).
        buckets = _groups.layout(group_norms, stacked, updates, state.group_norms, "agc", axis_name)
        norm, bucket_norms = _norms.tree_norms(unit_norms, kept_axes, 2.0, buckets)
        state = AGCState(
            global_norm=norm.astype(state.global_norm.dtype),
            threshold=_norms.tree_norm(unit_limits, kept_axes, 2.0).astype(state.threshold.dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return jax.tree.unflatten(treedef, out), state

    def update_fn(updates, state, params=None):
        return step(updates, state, params)

    def unscaling(updates, state, params, inverse_scale):
        updates, state = step(updates, state, params, inverse_scale)
        return updates, state, state.global_norm

    return _steps.register_unscaling(optax.GradientTransformation(init_fn, update_fn), unscaling)
