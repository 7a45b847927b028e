"""TensorFlow's clipping operations as pure functions on any pytree.

All of them are built on the norm in `_norms`: a clip is the norm, one scale computed from it and
the threshold, and every leaf multiplied by that scale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from optclip import _checks
from optclip.norms import _axes, _norms, _reductions, _scale


def global_norm(tree, *, ord=2, axis_name=None):
    r"""The norm of all leaves of a pytree together, as if they were one flat vector.

    .. math::
        \|g\|_p = \Big(\sum_{x \in \text{leaves}} \sum_i |x_i|^p\Big)^{1/p}

    Corresponds to ``tf.global_norm`` (``ord=2``) and to the total norm of
    ``torch.nn.utils.clip_grad_norm_`` (any ``ord``). Unlike both, float16 and bfloat16 leaves are
    accumulated in float32 across the whole tree, and values whose squares overflow still give a
    finite, correct norm.

    Args:
      tree: a pytree of floating-point or complex arrays (a single array is a tree). ``None`` and
        ``optax.MaskedNode`` leaves are ignored.
      ord: the order ``p``: 2 (default), 1, ``inf`` (largest magnitude) or any ``p > 0``.
      axis_name: inside ``shard_map`` or ``pmap``, the mesh axes the leaves are split over: a
        name, a tuple of names (every leaf), or a pytree of ``PartitionSpec`` s / names matching
        the tree or a prefix of it (``None`` or ``P()`` for a replicated leaf). Not needed under
        ``jit`` with sharded arrays. Under ``pmap`` it is taken on trust: a leaf that is the
        same on every device (gradients after ``lax.pmean``) is replicated, and declared split
        it is counted once per device; :func:`check_split` finds such a leaf.

    Returns:
      A 0-d float32 array (float64 if any leaf is float64 or complex128).

    Raises:
      TypeError: a leaf is not floating-point or complex (a non-numeric one: a str, a NumPy
        array of objects; the message names its path), or ``axis_name`` is not one of the
        accepted forms.
      ValueError: ``ord`` is not one of the accepted values, or ``axis_name`` does not match.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> norm = optclip.global_norm([jnp.array([-2., 3., 6.]), jnp.array([-4., 6., 12.])])
      >>> print(f"{norm:.5f}")  # sqrt(245)
      15.65248
      >>> print(optclip.global_norm({"w": jnp.array([3., -4.])}, ord=1))
      7.0
    """
    p = _checks.check_ord(ord)
    return _norms.global_norm_of(tree, p, axis_name, "global_norm")


def clip_by_value(tree, clip_value_min, clip_value_max):
    r"""Clamps every element of every leaf into ``[clip_value_min, clip_value_max]``.

    .. math::
        x_i \mapsto \min(\max(x_i, \text{min}), \text{max})

    Corresponds to ``tf.clip_by_value``; a bound may also be ``None`` (no bound on that side),
    as in ``optax.tree.clip``, and with both ``None`` the tree is returned unchanged, as there.
    Clipping values changes the direction of a gradient; prefer :func:`clip_by_global_norm` for
    gradients.

    Args:
      tree: a pytree of real arrays (integer leaves are accepted, as in TensorFlow; float bounds
        are rounded inwards for them and saturate at the dtype's range, so ``inf`` is no bound).
      clip_value_min: lower bound: a scalar or an array that broadcasts to every leaf, or
        ``None`` for no lower bound.
      clip_value_max: upper bound, likewise.

    Returns:
      The clipped tree; every leaf keeps its shape and dtype. A traced NaN bound (under ``jit``
      or ``optax.inject_hyperparams``) makes floating-point leaves NaN.

    Raises:
      ValueError: concrete ``clip_value_min > clip_value_max``, a concrete NaN bound, or a bound
        that does not broadcast to a leaf (the message names the leaf).
      TypeError: a boolean or complex leaf, or a non-numeric one (a str, a NumPy array of
        objects; the message names its path); a complex bound (it has no order).

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> print(optclip.clip_by_value(jnp.array([-1., 2., 10.]), 0., 3.))
      [0. 2. 3.]
      >>> print(optclip.clip_by_value(jnp.array([-1., 2., 10.]), None, 3.))
      [-1.  2.  3.]
    """
    _checks.check_bounds(clip_value_min, clip_value_max)

    def clip_leaf(path, x):
        _checks.check_array_leaf(path, x, "`clip_by_value`")
        x = jnp.asarray(x)
        dtype = x.dtype
        if dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"`clip_by_value` needs real numeric leaves; leaf `{_checks.leaf_name(path)}` "
                f"has dtype {dtype}."
            )
        lo = _leaf_bound(clip_value_min, "clip_value_min", path, x, jnp.ceil)
        hi = _leaf_bound(clip_value_max, "clip_value_max", path, x, jnp.floor)
        return x if lo is None and hi is None else jnp.clip(x, lo, hi)

    return jax.tree_util.tree_map_with_path(clip_leaf, tree)


def _leaf_bound(bound, name, path, x, rounding):
    """`bound` checked against leaf `x` and cast to its dtype; None (no bound) stays None."""
    if bound is None:
        return None
    shape = np.shape(bound)
    try:
        fits = np.broadcast_shapes(shape, x.shape) == x.shape
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"`{name}` of shape {shape} does not broadcast to leaf "
            f"`{_checks.leaf_name(path)}` of shape {x.shape}."
        )
    if jnp.issubdtype(x.dtype, jnp.integer):
        if not jnp.issubdtype(jnp.result_type(bound), jnp.integer):
            return _integer_bound(jnp.asarray(bound), x.dtype, rounding)
        if isinstance(bound, jax.Array):  # saturated at the leaf's range, on the device
            info, own = jnp.iinfo(x.dtype), jnp.iinfo(bound.dtype)
            lo, hi = max(int(info.min), int(own.min)), min(int(info.max), int(own.max))
            return jnp.clip(bound, lo, hi).astype(x.dtype)
    # Concrete integers are converted on the host, exactly (saturated for an integer leaf).
    return _checks.as_array(bound, x.dtype)


def _integer_bound(bound, dtype, rounding):
    """A float bound for an integer leaf, in its dtype: rounded inwards (`rounding`) and
    saturated to the dtype's range, so an infinite bound is no bound."""
    info = jnp.iinfo(dtype)
    bound = rounding(bound)
    # Compared, not clipped in floating point: float(info.max) may round up past the range.
    inside = jnp.where(bound <= float(info.min), jnp.array(info.min, dtype), bound.astype(dtype))
    return jnp.where(bound >= float(info.max), jnp.array(info.max, dtype), inside)


def clip_by_norm(tree, clip_norm, axes=None):
    r"""Scales each leaf (or each slice of it) down to an L2 norm of at most `clip_norm`.

    .. math::
        x \mapsto x \cdot \frac{c}{\max(\|x\|_2, c)}

    Corresponds to ``tf.clip_by_norm``, applied to every leaf separately. With `axes`, the norm is
    taken over those axes and each slice is clipped on its own (``axes=[1]`` on a matrix clips
    each row). Clipping each tensor by its own norm changes their relative scale; prefer
    :func:`clip_by_global_norm` for gradients.

    Args:
      tree: a pytree of floating-point or complex arrays.
      clip_norm: the largest norm, a 0-d real number; negative values are treated as zero.
      axes: None (the whole leaf), an int or a sequence of ints; negative axes count from each
        leaf's last axis.

    Returns:
      The clipped tree; every leaf keeps its shape and dtype, and is unchanged bit for bit where
      its norm is at or under `clip_norm`. A slice whose norm is not finite becomes NaN, and
      so does every leaf for a traced NaN `clip_norm` (under ``jit``).

    Raises:
      ValueError: `clip_norm` is not 0-d or is NaN, or `axes` is out of range for a leaf.
      TypeError: an integer, boolean or non-numeric leaf (the message names its path); `axes`
        that are not None, an int or ints (``[0.5]``, ``True`` or ``jnp.array(1.5)`` are not
        truncated).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, optclip
      >>> x = jnp.array([[1., 2., 3., 4., 5.]])
      >>> print(np.round(np.float64(optclip.clip_by_norm(x, 2.0)), 4))
      [[0.2697 0.5394 0.809  1.0787 1.3484]]
      >>> print(optclip.clip_by_norm(jnp.array([[3., 4.], [0.3, 0.4]]), 1.0, axes=[1]))
      [[0.6 0.8]
       [0.3 0.4]]
    """
    _checks.check_scalar(clip_norm, "clip_norm")
    axes = _checks.check_axes(axes)

    def clip_leaf(path, x):
        _checks.check_float_leaf(path, x, "clip_by_norm")
        x = jnp.asarray(x)
        leaf_axes = None if axes is None else _checks.normalize_axes(axes, path, x.ndim)
        count = x.size if leaf_axes is None else math.prod(x.shape[a] for a in leaf_axes)
        return _clip_by_leaf_norm(x, leaf_axes, clip_norm, count)

    return jax.tree_util.tree_map_with_path(clip_leaf, tree)


def clip_by_average_norm(tree, clip_norm):
    r"""Scales each leaf down to an average L2 norm (norm / number of elements) of at most
    `clip_norm`.

    .. math::
        x \mapsto x \cdot \frac{c}{\max(\|x\|_2 / n, c)}, \quad n = \text{x.size}

    Corresponds to ``tf.clip_by_average_norm`` (removed in TensorFlow 2), applied to every leaf.

    Args:
      tree: a pytree of floating-point or complex arrays.
      clip_norm: the largest average norm, a 0-d real number; negative values are treated as zero.

    Returns:
      The clipped tree; every leaf keeps its shape and dtype. A leaf whose norm is not finite
      becomes NaN, and so does every leaf for a traced NaN `clip_norm`.

    Raises:
      ValueError: `clip_norm` is not 0-d, or is NaN.
      TypeError: an integer, boolean or non-numeric leaf (a str, a NumPy array of objects; the
        message names its path).

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> print(optclip.clip_by_average_norm(jnp.array([3., 4.]), 1.0))
      [1.2 1.6]
    """
    _checks.check_scalar(clip_norm, "clip_norm")
    return _clip_size_normalised(tree, clip_norm, lambda n: n, "clip_by_average_norm")


def clip_by_block_rms(tree, threshold):
    r"""Scales each leaf down to a root mean square (RMS) of at most `threshold`.

    .. math::
        x \mapsto x \cdot \frac{c}{\max(\operatorname{rms}(x), c)}, \quad
        \operatorname{rms}(x) = \sqrt{\tfrac{1}{n} \textstyle\sum_i |x_i|^2}
        = \|x\|_2 / \sqrt{n}, \quad n = \text{x.size}

    ``optax.clip_by_block_rms`` as a pure function (a block is one leaf: a weight vector or
    matrix); TensorFlow has none. Where optax divides each leaf by ``max(1, rms / c)`` computed
    in the leaf's dtype, this function differs on purpose: the RMS is accumulated in float32 (a
    float16 leaf whose squares overflow is clipped correctly; optax makes it zero), a leaf at or
    under the threshold is returned bit for bit, a negative threshold is treated as zero (optax
    then does not clip), zero input stays zero at a zero threshold (optax gives NaN), a leaf
    whose RMS is not finite becomes NaN (optax zeroes its finite entries), and the gradient is
    finite at zero input. Elsewhere the two agree to rounding.

    Args:
      tree: a pytree of floating-point or complex arrays (complex leaves use ``|z|^2``).
      threshold: the largest RMS, a 0-d real number; negative values are treated as zero.

    Returns:
      The clipped tree; every leaf keeps its shape and dtype. A leaf whose RMS is not finite
      becomes NaN, and so does every leaf for a traced NaN `threshold`.

    Raises:
      ValueError: `threshold` is not 0-d, or is NaN.
      TypeError: an integer, boolean or non-numeric leaf (a str, a NumPy array of objects; the
        message names its path).

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> tree = {"w": jnp.array([3., 4., 0., 0.]), "b": jnp.array([0.5, -0.5])}
      >>> out = optclip.clip_by_block_rms(tree, 1.0)  # RMS 2.5 and 0.5
      >>> print(out["w"], out["b"])
      [1.2 1.6 0.  0. ] [ 0.5 -0.5]
    """
    _checks.check_scalar(threshold, "threshold")
    return _clip_size_normalised(tree, threshold, math.sqrt, "clip_by_block_rms")


def _clip_size_normalised(tree, threshold, divisor, what: str):
    """Each leaf scaled down so that its 2-norm divided by ``divisor(size)`` (the size counted
    as 1 for an empty leaf) is at most `threshold`: the average norm, or the RMS."""

    def clip_leaf(path, x):
        _checks.check_float_leaf(path, x, what)
        x = jnp.asarray(x)
        return _clip_by_leaf_norm(x, None, threshold, x.size, divisor(max(x.size, 1)))

    return jax.tree_util.tree_map_with_path(clip_leaf, tree)


def _clip_by_leaf_norm(x, axes, threshold, count: int, divisor=1):
    """`x` clipped so that its 2-norm over `axes` (or all of it), divided by `divisor`, is at
    most `threshold`.

    Zero rows are common (embedding gradients, frozen layers), and an exactly-zero sum of
    squares would send every step down the norm's rescaled path to find out whether the row
    is zero or made of values below ~1e-19 whose squares flushed. Such a row's norm is below
    `_reductions.hidden_norm(count)`: for a threshold known to be at least that large (any
    ordinary one) the row is not clipped either way, and its zero is trusted. For a smaller
    threshold, or one known only at run time (a schedule, `inject_hyperparams`, a threshold
    passed into `jit`), it is not, and the norm is exact.
    """
    acc = _reductions.accum_dtype(x.dtype)
    known = _checks.concrete(threshold)
    trust = known is not None and bool(
        max(float(known), 0.0) * divisor >= _reductions.hidden_norm(count, acc)
    )
    value = _norms.leaf_norm(x, 2.0, axes, zero_is_exact=trust) / divisor
    return _scale.clip(x, value, threshold)


def clip_by_global_norm(tree, clip_norm, use_norm=None, *, axis_name=None):
    r"""Scales all leaves by one factor so that their global L2 norm is at most `clip_norm`.

    .. math::
        x \mapsto x \cdot \frac{c}{\max(\|g\|_2, c)}, \quad
        \|g\|_2 = \sqrt{\textstyle\sum_{x} \|x\|_2^2}

    Corresponds to ``tf.clip_by_global_norm``: every gradient keeps its direction and relative
    scale. Differences on purpose: the norm is accumulated in float32 (no float16 overflow, exact
    for bfloat16), the gradient is finite at zero input (TensorFlow's is NaN), and a negative
    `clip_norm` is treated as zero.

    Args:
      tree: a pytree of floating-point or complex arrays (``None`` and ``optax.MaskedNode``
        leaves are kept and ignored).
      clip_norm: the largest global norm, a 0-d real number; negative values are treated as zero.
      use_norm: a 0-d global norm to use instead of computing it.
      axis_name: the mesh axes the leaves are split over inside ``shard_map``/``pmap``; see
        :func:`global_norm`.

    Returns:
      ``(clipped_tree, global_norm)``. Every leaf keeps its dtype and is unchanged bit for bit
      when the norm is at or under `clip_norm`. If the norm is not finite, or `clip_norm` is a
      traced NaN, every leaf is NaN.

    Raises:
      ValueError: `clip_norm` or `use_norm` is not 0-d; `clip_norm` is NaN (a NaN `use_norm`
        is a norm like any other: every leaf becomes NaN).
      TypeError: an integer, boolean or non-numeric leaf (a str, a NumPy array of objects; the
        message names its path).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, optclip
      >>> grads = [jnp.array([-2., 3., 6.]), jnp.array([-4., 6., 12.])]
      >>> clipped, norm = optclip.clip_by_global_norm(grads, 14.5)
      >>> print(f"{norm:.5f}", np.round(np.float64(clipped[0]), 4))
      15.65248 [-1.8527  2.7791  5.5582]
    """
    _checks.check_scalar(clip_norm, "clip_norm")
    leaves = _norms.float_leaves(tree, "clip_by_global_norm")
    dtype = _reductions.widest_accum_dtype([x.dtype for x in leaves])
    if use_norm is None:
        axes = _axes.leaf_axes(tree, axis_name, "clip_by_global_norm")
        norm = _norms.tree_norm(leaves, axes, 2.0)
    else:
        _checks.check_scalar(use_norm, "use_norm", allow_nan=True)
        norm = jnp.asarray(use_norm).astype(dtype)
    return _scale.clip_tree(tree, norm, _scale.threshold_as(clip_norm, norm.dtype)), norm
