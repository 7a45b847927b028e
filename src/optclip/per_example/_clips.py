"""Per-example clipping (DP-SGD): a batch of per-example gradients clipped and summed.

Computed as per-example norms, one scale per example (`_scale.clip_scale`), then one
contraction per leaf over the batch axis with the scales. No clipped copy of the per-example
gradients is ever made.

The per-example norms are the library's norm (`_reductions.norm_with_rules`: the plain sums of
squares, one `lax.cond` for the overflow/underflow fallback, the exact derivative) with the batch
axis kept: one fused sum of squares per leaf, as in optax. (`jax.vmap` of `_norms.tree_norm`
gives the same numbers, but under `vmap` its stacking of small leaves of one shape copies every
such leaf of the whole batch.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from optclip import _checks
from optclip.norms import _reductions, _scale

NONFINITE = ("propagate", "zero")


def _batched_leaves(grads, what: str):
    """The leaves of `grads` as arrays, checked: floating-point or complex, each with the same
    leading batch axis. Returns ``(leaves, treedef)``."""
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(grads)
    leaves, first = [], None
    for path, leaf in paths_and_leaves:
        _checks.check_float_leaf(path, leaf, what)
        x = jnp.asarray(leaf)
        if x.ndim == 0:
            raise ValueError(
                f"`{what}` needs a leading batch axis on every leaf of `grads`; leaf "
                f"`{_checks.leaf_name(path)}` is 0-d (shape ())."
            )
        if first is None:
            first = (path, x.shape[0])
        elif x.shape[0] != first[1]:
            raise ValueError(
                f"`{what}` needs the same batch size (leading axis) on every leaf of `grads`; "
                f"leaf `{_checks.leaf_name(path)}` has {x.shape[0]} (shape {x.shape}), leaf "
                f"`{_checks.leaf_name(first[0])}` has {first[1]}."
            )
        leaves.append(x)
    return leaves, treedef


def _prepare(grads, max_norm, nonfinite, what: str):
    """The arguments both per-example clips share, checked: ``(leaves, treedef, accumulation
    dtype, max_norm as a threshold of that dtype)``."""
    _checks.check_scalar(max_norm, "max_norm")
    _checks.check_choice(nonfinite, "nonfinite", NONFINITE)
    leaves, treedef = _batched_leaves(grads, what)
    dtype = _reductions.widest_accum_dtype([x.dtype for x in leaves])
    return leaves, treedef, dtype, _scale.threshold_as(max_norm, dtype)


def _work_dtype(dtype):
    """The dtype a leaf is contracted in: its own, or float32 for float16 and bfloat16 (as in
    `_scale.apply_scale`)."""
    dtype = jnp.dtype(dtype)
    return dtype if jnp.finfo(dtype).bits >= 32 else jnp.dtype(jnp.float32)


def _summed_sharding(x):
    """Under JAX's explicit sharding, with `x`'s batch axis split over the mesh: the sharding
    of its sum over that axis (the rest of its spec; the contraction is then unambiguous).
    Else None."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if not spec or spec[0] is None:
        return None
    return jax.sharding.PartitionSpec(*spec[1:])


def _weighted_sum(scales, x):
    """``sum_b scales[b] * x[b]``: one contraction over the batch axis, accumulated in float32
    for float16/bfloat16 leaves and rounded once to `x`'s dtype. At HIGHEST precision: JAX's
    default on a GPU (TF32) or a TPU (bfloat16) would round every scale and gradient to 10 or
    8 bits first (a matrix-vector product, which reads every gradient once at any precision)."""
    work = _work_dtype(x.dtype)
    total = lax.dot_general(
        scales.astype(work),
        x,
        (((0,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=work,
        out_sharding=_summed_sharding(x),
    )
    return total.astype(x.dtype)


def example_norms(leaves, *, per_leaf: bool):
    """The 2-norms of every example of `leaves` (arrays sharing a leading batch axis): of all
    leaves together, shape (B,), or of each leaf, shape (K, B) with `per_leaf` (a row per
    leaf).

    Accumulated in float32 (float64 if any leaf is float64 or complex128); correct when squares
    overflow or underflow (the fallback runs under one `lax.cond`, for every example at once, only
    when some example needs it). An example (or leaf of it) that is exactly zero is trusted, as
    in per-slice norms: padding examples do not send every step down the slow path.
    """
    dtype = _reductions.widest_accum_dtype([x.dtype for x in leaves])
    count = sum(math.prod(x.shape[1:]) for x in leaves)  # the elements of one example

    def per_example(arrays, reducer, combine):
        parts = [reducer(a, axis=tuple(range(1, a.ndim))).astype(dtype) for a in arrays]
        return jnp.stack(parts) if per_leaf else functools.reduce(combine, parts)

    def reduce(terms):  # terms[0][i]: the elementwise terms of leaf i (one view)
        return per_example(terms[0], jnp.sum, jnp.add)

    def largest(arrays):
        magnitudes = [_reductions.part_magnitude(a) for a in arrays]
        return per_example(magnitudes, functools.partial(jnp.max, initial=0), jnp.maximum)

    def expand(values, i, a):
        if values is None:
            return [None]  # one view
        v = values[i] if per_leaf else values
        return [v.reshape(v.shape + (1,) * (a.ndim - 1))]

    return _reductions.norm_with_rules(
        list(leaves),
        2.0,
        reduce=reduce,
        largest=largest,
        expand=expand,
        needs_rescale=lambda total: _reductions.needs_rescale(total, 2.0, count, True),
        acc=dtype,
    )


def _finite_examples(norms):
    """Examples whose norms (shape (B,) or (K, B)) are all finite."""
    finite = jnp.isfinite(norms)
    return finite if finite.ndim == 1 else jnp.all(finite, axis=0)


def _sums(leaves, scales_of, finite, nonfinite: str):
    """Every leaf's weighted sum over the batch (`scales_of(i)` are leaf i's scales, shape (B,)).

    With ``nonfinite="zero"``, the examples that are not `finite` contribute nothing: their
    scales and their values are zeroed (values too, since ``0 * inf`` is NaN), on a second path
    taken only when there is such an example.
    """

    def plain():
        return [_weighted_sum(scales_of(i), x) for i, x in enumerate(leaves)]

    if nonfinite == "propagate":
        return plain()

    def dropped():
        return _zeroed_sums(leaves, scales_of, finite)

    all_finite = jnp.all(finite)
    if not _checks.is_traced(all_finite):
        # Eager: decide in Python rather than trace and compile a `cond` on every call.
        return plain() if bool(all_finite) else dropped()
    return lax.cond(all_finite, plain, dropped)


def _zeroed_sums(leaves, scales_of, finite):
    """`_sums` with the examples that are not `finite` zeroed (their scales and values)."""
    out = []
    for i, x in enumerate(leaves):
        keep = finite.reshape(finite.shape + (1,) * (x.ndim - 1))
        x = jnp.where(keep, x, jnp.zeros((), x.dtype))
        out.append(_weighted_sum(jnp.where(finite, scales_of(i), 0), x))
    return out


def _count(over):
    """How many entries of the boolean `over` (shape (B,)) are true, as an int32 scalar."""
    return jnp.sum(over, dtype=jnp.int32)


def per_example_clip(grads, max_norm, *, nonfinite="propagate", return_norms=False):
    r"""Clips every example's gradient to a global L2 norm of at most `max_norm`, and sums them.

    .. math::
        \sum_{b=1}^{B} g_b \cdot \frac{c}{\max(\|g_b\|_2, c)}, \quad
        \|g_b\|_2 = \sqrt{\textstyle\sum_{x} \|x_b\|_2^2}

    The clipping step of DP-SGD (Abadi et al. 2016): ``g_b`` is example b's slice of every leaf
    of `grads` (all leaves share the leading batch axis), its norm is the global norm of that
    slice (:func:`global_norm`), and the clipped gradients are summed over the batch. The same
    result as ``jax.vmap(lambda g: clip_by_global_norm(g, c)[0])(grads)`` summed over the batch,
    computed without that per-example clipped copy: the per-example norms first, then one
    contraction over the batch axis per leaf with the scales.

    A drop-in for ``optax.per_example_global_norm_clip``: the same arguments and the same
    ``(summed, num_clipped)``, so ``summed, num_clipped = per_example_clip(grads, c)`` works
    for both (the norms on request, ``return_norms=True``). Differences on purpose: any pytree
    (optax takes a list of arrays), the norm is accumulated in float32
    for float16/bfloat16 and stays finite and correct when squares overflow (optax takes such an
    example, of values ``1e20``, or float16 values whose squares overflow float16, for one of
    infinite norm and drops it), a negative `max_norm` is treated as zero, the sum is
    accumulated in float32 for float16/bfloat16 leaves, and a non-finite example makes the sum
    NaN by default, or is left out with ``nonfinite="zero"``. TensorFlow has no such function
    (TensorFlow Privacy clips each microbatch with ``tf.clip_by_global_norm``).

    Args:
      grads: a pytree of floating-point or complex arrays, every leaf with the same leading
        batch axis of size ``B`` (``None`` and ``optax.MaskedNode`` leaves are kept and
        ignored).
      max_norm: the largest per-example norm, a 0-d real number or traced value; negative
        values are treated as zero.
      nonfinite: what an example of non-finite norm does: ``"propagate"`` (default) makes every
        leaf of the sum NaN, as a non-finite global norm does in :func:`clip_by_global_norm`;
        ``"zero"`` leaves it out of the sum (it contributes nothing).
      return_norms: also return the per-example norms (a third value).

    Returns:
      ``(summed, num_clipped)``, as optax: the sum over the batch of the clipped gradients (the
      structure of `grads`, every leaf without its batch axis and in its own dtype) and the
      number of examples of finite norm that were scaled down (an int32 scalar). With
      ``return_norms=True``, ``(summed, num_clipped, norms)``: also the per-example norms
      before clipping (shape ``(B,)``, float32, float64 if any leaf is float64 or complex128;
      count the non-finite ones with ``jnp.sum(~jnp.isfinite(norms))``).

    Raises:
      ValueError: a leaf has no batch axis (0-d) or a batch size other than the first leaf's
        (the message names both), `max_norm` is not 0-d or is NaN, or `nonfinite` is unknown.
      TypeError: an integer, boolean or non-numeric leaf (the message names its path), or
        `return_norms` is not a bool.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> grads = {"w": jnp.array([[6., 8.], [0.3, 0.4], [3e20, 4e20]])}  # 3 examples
      >>> summed, num_clipped = optclip.per_example_clip(grads, 1.0)
      >>> print(summed["w"], num_clipped)
      [1.5 2. ] 2
      >>> _, _, norms = optclip.per_example_clip(grads, 1.0, return_norms=True)
      >>> print(norms)
      [1.e+01 5.e-01 5.e+20]

    References:
      Abadi et al., 2016, Deep Learning with Differential Privacy,
      https://arxiv.org/abs/1607.00133
    """
    return_norms = _checks.check_bool(return_norms, "return_norms")
    leaves, treedef, dtype, threshold = _prepare(grads, max_norm, nonfinite, "per_example_clip")
    if not leaves:
        out = grads, jnp.zeros((), jnp.int32), jnp.zeros((0,), dtype)
        return out if return_norms else out[:2]
    norms = example_norms(leaves, per_leaf=False)
    scales = _scale.clip_scale(norms, threshold)
    finite = jnp.isfinite(norms)
    summed = _sums(leaves, lambda i: scales, finite, nonfinite)
    num_clipped = _count(finite & (norms > threshold))
    summed = jax.tree.unflatten(treedef, summed)
    return (summed, num_clipped, norms) if return_norms else (summed, num_clipped)


def per_example_layer_clip(
    grads, max_norm, uniform=True, *, nonfinite="propagate", return_norms=False
):
    r"""Clips every example's gradient leaf by leaf (layer by layer), and sums them.

    .. math::
        \sum_{b=1}^{B} x_b \cdot \frac{c_x}{\max(\|x_b\|_2, c_x)}, \quad
        c_x = \frac{c}{\sqrt{K}} \ \text{(uniform)} \quad\text{or}\quad
        c_x = c \sqrt{D_x / D}

    for every leaf ``x`` of the ``K`` leaves, ``x_b`` its slice for example b, ``D_x`` the
    number of its elements per example and ``D`` theirs over all leaves. Either way the clipped
    example has a global norm of at most ``c``: ``sum_x c_x**2 == c**2``.

    Per-layer clipping for DP-SGD (McMahan et al. 2017), and a drop-in for
    ``optax.per_example_layer_norm_clip``: the same arguments (`max_norm` is optax's
    ``global_l2_norm_clip``) and the same ``(summed, num_clipped)``, with any pytree and the
    numerics of
    :func:`per_example_clip`: norms accumulated in float32 and correct when squares overflow,
    a negative threshold treated as zero, float32 accumulation of the sums, and a non-finite
    example NaN by default. One pass computes the norms of every leaf of every example (one
    `lax.cond` for the overflow fallback), then one contraction per leaf.

    Args:
      grads: a pytree of floating-point or complex arrays, every leaf with the same leading
        batch axis of size ``B`` (``None`` and ``optax.MaskedNode`` leaves are kept and
        ignored, and do not count as layers).
      max_norm: the overall threshold ``c``, a 0-d real number or traced value; negative values
        are treated as zero.
      uniform: if True (default), every leaf's threshold is ``c / sqrt(K)``; if False, it is
        ``c * sqrt(D_x / D)``, so a leaf's share follows its size.
      nonfinite: what an example with a non-finite norm in any leaf does: ``"propagate"``
        (default) makes every leaf of the sum NaN; ``"zero"`` leaves that example out of the
        sum entirely (every leaf of it, not just the non-finite one).
      return_norms: also return each leaf's per-example norms (a third value).

    Returns:
      ``(summed, num_clipped)``, as optax, each with the structure of `grads`: the sum over the
      batch of the clipped gradients (every leaf without its batch axis, in its own dtype), and
      for each leaf, the number of examples (of finite norms in every leaf) that it scaled down
      (int32 scalars). With ``return_norms=True``, ``(summed, num_clipped, norms)``: also each
      leaf's per-example norms before clipping (shape ``(B,)``, float32, float64 if any leaf is
      float64 or complex128).

    Raises:
      ValueError: a leaf has no batch axis (0-d) or a batch size other than the first leaf's,
        `max_norm` is not 0-d or is NaN, or `nonfinite` is unknown.
      TypeError: an integer, boolean or non-numeric leaf (the message names its path), or
        `uniform` or `return_norms` is not a bool (they decide the program: with ``jax.jit``,
        make them static arguments).

    Examples:
      >>> import jax.numpy as jnp, numpy as np, optclip
      >>> grads = {"a": jnp.array([[6., 8.], [0.3, 0.4]]), "b": jnp.array([[0.5], [-3.]])}
      >>> summed, num_clipped = optclip.per_example_layer_clip(grads, 2.0)
      >>> print(np.round(np.float64(summed["a"]), 4), np.round(np.float64(summed["b"]), 4))
      [1.1485 1.5314] [-0.9142]
      >>> print(num_clipped["a"], num_clipped["b"])
      1 1
      >>> _, _, norms = optclip.per_example_layer_clip(grads, 2.0, return_norms=True)
      >>> print(norms["a"], norms["b"])
      [10.   0.5] [0.5 3. ]

    References:
      McMahan et al., 2017, Learning Differentially Private Recurrent Language Models,
      https://arxiv.org/abs/1710.06963
    """
    uniform = _checks.check_bool(uniform, "uniform")
    return_norms = _checks.check_bool(return_norms, "return_norms")
    what = "per_example_layer_clip"
    leaves, treedef, dtype, threshold = _prepare(grads, max_norm, nonfinite, what)
    if not leaves:
        return (grads, grads, grads) if return_norms else (grads, grads)
    count = len(leaves)
    sizes = [math.prod(x.shape[1:]) for x in leaves]
    total = sum(sizes)
    if uniform:
        shares = [(1.0 / count) ** 0.5] * count
    else:
        shares = [(size / total) ** 0.5 if total else 1.0 for size in sizes]
    thresholds = threshold * jnp.asarray(shares, dtype)[:, None]  # (K, 1)

    norms = example_norms(leaves, per_leaf=True)  # (K, B)
    finite = _finite_examples(norms)
    scales = _scale.clip_scale(norms, thresholds)
    # A non-finite example makes every leaf NaN, not just its own (no half-applied step).
    scales = jnp.where(finite, scales, jnp.nan)
    summed = _sums(leaves, lambda i: scales[i], finite, nonfinite)
    num_clipped = jnp.sum(finite & (norms > thresholds), axis=1, dtype=jnp.int32)
    out = (
        jax.tree.unflatten(treedef, summed),
        jax.tree.unflatten(treedef, [num_clipped[i] for i in range(count)]),
    )
    if not return_norms:
        return out
    return (*out, jax.tree.unflatten(treedef, [norms[i] for i in range(count)]))
