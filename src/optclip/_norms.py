"""The norm: one routine serves every clipping mode.

* Accumulation: float32 for float16, bfloat16, float32 and complex64 leaves; float64 for float64
  and complex128 leaves; across leaves in the widest of these.
* Overflow and underflow: the plain sum of ``|x|**p`` is computed first. Only when it overflows
  (``inf``) or underflows (below the smallest normal number) is the norm computed again with every
  value divided by the largest magnitude, under `lax.cond`, so the common path pays one scalar
  comparison.
* Gradients: square roots and fractional powers are guarded so that the gradient is finite
  everywhere, zero input included.
* Many leaves: small leaves of one shape, dtype and sharding are stacked and reduced together, so
  compile time does not grow with one kernel per leaf.
* Devices: partial sums of leaves split over mesh axes are all-reduced (`psum`, or `pmax` for the
  infinity norm) over exactly those axes, once per distinct set of axes; replicated leaves are
  counted once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from optclip import _checks

# Leaves with at most this many elements are stacked with others of their shape before reducing.
STACK_MAX_SIZE = 1 << 14
# At most this many leaves go into one stack (XLA compiles huge concatenations slowly).
STACK_CHUNK = 128


def accum_dtype(dtype) -> np.dtype:
    """The real dtype a leaf's norm is accumulated in."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.float64), jnp.dtype(jnp.complex128)):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def widest_accum_dtype(dtypes: Sequence) -> np.dtype:
    """The accumulation dtype for a set of leaves: float64 if any leaf needs it."""
    accs = {accum_dtype(d) for d in dtypes}
    return jnp.dtype(jnp.float64) if jnp.dtype(jnp.float64) in accs else jnp.dtype(jnp.float32)


def _is_static(p) -> bool:
    return isinstance(p, float)


def _pow0(a, q):
    """``a ** q`` for ``a >= 0`` with a finite gradient at ``a == 0`` (for ``q < 1`` too)."""
    if _is_static(q) and q == 1.0:
        return a
    if _is_static(q) and q > 1.0:
        return a**q
    zero = a == 0  # (not `a > 0`, which would turn NaN into 0)
    return jnp.where(zero, 0, jnp.where(zero, 1, a) ** q)


def _root(total, p):
    """``total ** (1 / p)`` with a finite gradient at zero."""
    if _is_static(p) and p == 1.0:
        return total
    if _is_static(p) and p == 2.0:
        zero = total == 0
        return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, total)))
    return _pow0(total, 1 / p)


def _parts(x):
    """The real components of `x` in its accumulation dtype: ``(x,)`` or ``(re, im)``."""
    acc = accum_dtype(x.dtype)
    if jnp.iscomplexobj(x):
        return jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
    return (x.astype(acc),)


def power_of_two_scale(m):
    """A power of two within a factor 2 of ``m > 0`` (1 for zero or non-finite ``m``), and its
    reciprocal; both are normal numbers, so scaling by them is exact.

    (Dividing by ``m`` itself is not safe: XLA may multiply by ``1 / m``, which for ``m > 2**126``
    is subnormal and flushed to zero.)
    """
    info = jnp.finfo(m.dtype)
    _, exponent = jnp.frexp(m)
    exponent = jnp.clip(exponent, info.minexp, info.maxexp - 2)
    exponent = jnp.where((m > 0) & (m < jnp.inf), exponent, 0)
    one = jnp.ones_like(m)
    return jnp.ldexp(one, exponent), jnp.ldexp(one, -exponent)


def magnitude_power(x, p, inverse_scale=None):
    """``|x * inverse_scale| ** p`` elementwise, in the accumulation dtype (``|z|**2`` for
    complex)."""
    parts = _parts(x)
    if inverse_scale is not None:
        parts = tuple(c * inverse_scale.astype(c.dtype) for c in parts)
    if len(parts) == 2:
        square = parts[0] * parts[0] + parts[1] * parts[1]
        if _is_static(p) and p == 2.0:
            return square
        return _pow0(square, p / 2)
    (a,) = parts
    if _is_static(p) and p == 2.0:
        return a * a
    return _pow0(jnp.abs(a), p)


def _largest_part(x, axes, keepdims):
    """The largest ``|component|`` (a scale within a factor sqrt(2) of the largest magnitude),
    in the accumulation dtype. The maximum is exact in the leaf's own dtype, so it is taken
    there and only the result is converted."""
    parts = [jnp.abs(jnp.real(x)), jnp.abs(jnp.imag(x))] if jnp.iscomplexobj(x) else [jnp.abs(x)]
    a = parts[0] if len(parts) == 1 else jnp.maximum(*parts)
    return jnp.max(a, axis=axes, keepdims=keepdims, initial=0).astype(accum_dtype(x.dtype))


def _largest_magnitude(x, axes, keepdims):
    """``max |x|`` exactly (the infinity norm), with a finite gradient at zero."""
    if not jnp.iscomplexobj(x):
        return _largest_part(x, axes, keepdims)
    z = x.astype(jnp.promote_types(x.dtype, jnp.complex64))
    nonzero = z != 0
    a = jnp.where(nonzero, jnp.abs(jnp.where(nonzero, z, 1)), 0)
    return jnp.max(a, axis=axes, keepdims=keepdims, initial=0)


def _needs_rescale(total, p, zero_is_exact: bool):
    """Where a plain sum of powers lost the norm: it overflowed or underflowed.

    A sum that is exactly zero comes from an all-zero input or from values whose powers all
    flushed to zero (below ~1e-19 for float32 squares). With `zero_is_exact` it is trusted, so
    that zero slices, common in per-slice clipping, do not take the slow path; orders above 2
    flush much sooner (``1e-5 ** 8``) and never trust it.
    """
    tiny = jnp.finfo(total.dtype).smallest_normal
    if zero_is_exact and _is_static(p) and p <= 2.0:
        low = (total > 0) & (total < tiny)
    else:
        low = total < tiny
    return (total == jnp.inf) | low


def _rescaled_norm(largest: Callable, rescaled_total: Callable, p):
    """``m * (sum |x / m| ** p) ** (1/p)`` with ``m`` the largest magnitude (a power of two near
    it, so the scaling is exact): the norm when the plain sum overflowed or underflowed."""
    m = largest()
    # The norm does not depend on the scale, so no gradient flows through it (its derivative
    # would divide by scale**2, which overflows).
    scale, inverse = lax.stop_gradient(power_of_two_scale(m))
    norm = scale * _root(rescaled_total(inverse), p)
    return jnp.where(m == jnp.inf, jnp.inf, norm)


def _safe_norm(total, p, largest: Callable, rescaled_total: Callable, zero_is_exact: bool):
    """The norm from a plain sum of powers, or, if that sum lost it, from a rescaled one.

    `largest()` gives the largest magnitude and `rescaled_total(inverse_scale)` the sum of
    ``|x * inverse_scale| ** p``; both are only evaluated when the plain sum overflowed or
    underflowed.
    """

    def plain():
        return _root(total, p)

    def rescaled():
        return _rescaled_norm(largest, rescaled_total, p).astype(total.dtype)

    needs_rescale = jnp.any(_needs_rescale(total, p, zero_is_exact))
    if not isinstance(needs_rescale, jax.core.Tracer):
        # Eager: decide in Python rather than trace and compile a `cond` on every call.
        return rescaled() if bool(needs_rescale) else plain()
    return lax.cond(needs_rescale, rescaled, plain)


def leaf_norm(x, p: float = 2.0, axes=None):
    """The `p`-norm of one array, over `axes` (kept as size-1 dimensions) or over all of it.

    `axes` must already be normalised (a tuple of non-negative ints) or None.
    """
    keepdims = axes is not None
    if p == math.inf:
        return _largest_magnitude(x, axes, keepdims)

    def reduce(arrays):
        return jnp.sum(arrays[0], axis=axes, keepdims=keepdims)

    return _norm_with_rules(
        [x], p, reduce, lambda arrays: _largest_part(arrays[0], axes, keepdims), True
    )


def _norm_with_rules(arrays, p: float, reduce, largest, zero_is_exact: bool):
    """The `p`-norm of `arrays` (a list), with a batching rule and a differentiation rule.

    `reduce(list)` sums a list of elementwise arrays (one per input array) the way the norm
    needs (over some axes of one leaf, or over every leaf); `largest(arrays)` is the largest
    magnitude with the same reduction. The norm itself is `_safe_norm`'s. Two custom rules:

    * `vmap` (per-example clipping): a `lax.cond` with a batched predicate would become a
      `select` running both branches for every example; the rule keeps one `cond`, on whether
      any example needs the fallback.
    * differentiation: `d||x||_p = sum((|x|/n)**(p-2) * (x/n) * dx)`, with `x/n` computed with a
      power-of-two scale (no overflow, no flush to zero); zero at `n == 0`. This is the exact
      derivative of the norm, whichever branch computed it.
    """

    def totals(arrays, inverse_scale=None):
        return reduce([magnitude_power(a, p, inverse_scale) for a in arrays])

    def compute(arrays):
        return _safe_norm(
            totals(arrays),
            p,
            lambda: largest(arrays),
            lambda inv: totals(arrays, inv),
            zero_is_exact,
        )

    if not any(isinstance(a, jax.core.Tracer) for a in arrays):
        return compute(arrays)  # eager: no transformation to write rules for

    @jax.custom_batching.custom_vmap
    def batched(arrays):
        return compute(arrays)

    @batched.def_vmap
    def batched_rule(axis_size, in_batched, arrays):
        del axis_size
        flags = in_batched[0]
        if not any(flags):
            return compute(arrays), False
        in_axes = ([0 if flag else None for flag in flags],)
        total = jax.vmap(totals, in_axes=in_axes)(arrays)
        plain = _root(total, p)
        needs = _needs_rescale(total, p, zero_is_exact)

        def with_fallback():
            rescaled = jax.vmap(
                lambda a: _rescaled_norm(lambda: largest(a), lambda inv: totals(a, inv), p),
                in_axes=in_axes,
            )(arrays)
            return jnp.where(needs, rescaled.astype(plain.dtype), plain)

        return lax.cond(jnp.any(needs), with_fallback, lambda: plain), True

    @jax.custom_jvp
    def norm(arrays):
        return batched(arrays)

    @norm.defjvp
    def norm_jvp(primals, tangents):
        (arrays,), (darrays,) = primals, tangents
        n = norm(arrays)
        return n, reduce([_norm_tangent(a, da, n, p) for a, da in zip(arrays, darrays)])

    return norm(arrays)


def _norm_tangent(x, dx, n, p: float):
    """Elementwise terms of the derivative of the `p`-norm `n` of `x` in the direction `dx`."""
    n_safe = jnp.where((n == 0) | ~jnp.isfinite(n), 1, n)
    _, inverse = power_of_two_scale(n_safe)
    n_scaled = n_safe * inverse  # in [0.5, 1): dividing by it is safe
    ratio = [c * inverse.astype(c.dtype) / n_scaled.astype(c.dtype) for c in _parts(x)]
    directional = sum(r * d for r, d in zip(ratio, _parts(jnp.asarray(dx, x.dtype))))
    if p != 2.0:
        magnitude = jnp.abs(ratio[0]) if len(ratio) == 1 else jnp.hypot(*ratio)
        directional = _pow0(magnitude, p - 2) * directional
    return jnp.where(n == 0, 0, directional).astype(n.dtype)


# ----------------------------------------------------------------------------------------------
# Global norm over many leaves, possibly split over mesh axes.


def _sharding_key(x):
    try:
        return jax.typeof(x).sharding
    except Exception:  # noqa: BLE001 - no sharding information: group by shape alone.
        return None


def _stack_leaves(leaves, leaf_axes) -> tuple[list, list]:
    """The arrays to reduce: big leaves alone, small ones stacked with their like (shape, dtype,
    mesh axes, sharding), at most `STACK_CHUNK` to a stack; and each array's mesh axes.

    Every element of every leaf is in exactly one array. Stacking comes first, before any
    elementwise work, so that the norm's program has a few operations per stack rather than a
    few per leaf (with 2000 leaves, that is the difference between ~1 s and ~1 min of
    compilation on CPU).
    """
    arrays, array_axes, groups = [], [], {}
    for x, axes in zip(leaves, leaf_axes):
        if x.size > STACK_MAX_SIZE:
            arrays.append(x)
            array_axes.append(axes)
            continue
        key = (x.shape, x.dtype, axes, _sharding_key(x))
        groups.setdefault(key, []).append(x)
    for (_, _, axes, _), xs in groups.items():
        for start in range(0, len(xs), STACK_CHUNK):
            chunk = xs[start : start + STACK_CHUNK]
            arrays.append(chunk[0] if len(chunk) == 1 else jnp.stack(chunk))
            array_axes.append(axes)
    return arrays, array_axes


def _combine(arrays, array_axes, reduce_fn, how: str, dtype):
    """Reduces every array to a scalar with `reduce_fn`, then across arrays and devices.

    `how` is "sum" or "max". Partials of arrays split over the same mesh axes are combined
    first and all-reduced once over those axes.
    """
    by_axes: dict = {}
    for array, axes in zip(arrays, array_axes):
        by_axes.setdefault(axes, []).append(reduce_fn(array).astype(dtype))
    totals = []
    for axes, parts in by_axes.items():
        stacked = jnp.stack(parts) if len(parts) > 1 else parts[0]
        total = jnp.sum(stacked) if how == "sum" else jnp.max(stacked)
        if axes:
            total = lax.psum(total, axes) if how == "sum" else lax.pmax(total, axes)
        totals.append(total)
    stacked = jnp.stack(totals) if len(totals) > 1 else totals[0]
    return jnp.sum(stacked) if how == "sum" else jnp.max(stacked)


def _tree_norm(leaves, leaf_axes, p, dtype):
    """The global norm of already stacked `leaves` for a static order, or a traced finite
    one."""
    if _is_static(p) and p == math.inf:
        return _combine(
            leaves, leaf_axes, lambda a: _largest_magnitude(a, None, False), "max", dtype
        )

    def largest_of(arrays):
        return _combine(arrays, leaf_axes, lambda a: _largest_part(a, None, False), "max", dtype)

    def reduce(arrays):
        return _combine(arrays, leaf_axes, jnp.sum, "sum", dtype)

    if _is_static(p) and not any(leaf_axes):
        return _norm_with_rules(list(leaves), p, reduce, largest_of, False)
    # Inside shard_map/pmap (collectives) or for a traced order: plain autodiff and batching.

    def total_for(inverse_scale):
        return reduce([magnitude_power(a, p, inverse_scale) for a in leaves])

    return _safe_norm(
        total_for(None), p, lambda: largest_of(leaves), total_for, zero_is_exact=False
    )


def _tree_norm_traced(leaves, leaf_axes, p, dtype):
    """The norm for an order known only at run time (`inject_hyperparams`): one branch runs."""
    p = jnp.asarray(p).astype(dtype)
    index = jnp.where(
        p == 2, 0, jnp.where(p == 1, 1, jnp.where(p == jnp.inf, 2, jnp.where(p > 0, 3, 4)))
    )
    branches = [
        lambda: _tree_norm(leaves, leaf_axes, 2.0, dtype),
        lambda: _tree_norm(leaves, leaf_axes, 1.0, dtype),
        lambda: _tree_norm(leaves, leaf_axes, math.inf, dtype),
        lambda: _tree_norm(leaves, leaf_axes, p, dtype),
        lambda: jnp.full((), jnp.nan, dtype),  # an order that is not > 0
    ]
    return lax.switch(index, branches)


def tree_norm(leaves: Sequence, leaf_axes: Sequence[tuple], p):
    """The `p`-norm of all `leaves` together; `leaf_axes[i]` are the mesh axes leaf i is split over.

    `p` is a Python float from `_checks.check_ord`, or a traced order.
    """
    dtype = widest_accum_dtype([x.dtype for x in leaves])
    if not leaves:
        return jnp.zeros((), dtype)
    leaves, leaf_axes = _stack_leaves(leaves, leaf_axes)
    if _is_static(p):
        return _tree_norm(leaves, leaf_axes, p, dtype)
    return _tree_norm_traced(leaves, leaf_axes, p, dtype)


# ----------------------------------------------------------------------------------------------
# Which mesh axes each leaf is split over.


def _is_spec_leaf(value) -> bool:
    return (
        value is None
        or isinstance(value, (str, PartitionSpec))
        or (isinstance(value, tuple) and all(isinstance(v, str) for v in value) and value != ())
    )


def _spec_axes(spec) -> tuple:
    """The mesh axis names a `PartitionSpec`, a name, a tuple of names or None splits over."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        return (spec,)
    names = []
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        names.extend([entry] if isinstance(entry, str) else list(entry))
    for name in names:
        if not isinstance(name, str):
            raise ValueError(
                f"`axis_name` entries must be mesh axis names, got {name!r} in {spec}."
            )
    return tuple(sorted(set(names)))


class _LeafSpecs:
    """The specs of the leaves under one `axis_name` entry: an opaque pytree leaf, so that list
    nodes in `axis_name` (a list of `PartitionSpec`s) are not mistaken for results."""

    def __init__(self, specs: list):
        self.specs = specs


def leaf_specs(tree, axis_name) -> list:
    """For each leaf of `tree` (in order), the part of `axis_name` that describes it: None, a mesh
    axis name, a tuple of names or a `PartitionSpec`."""
    n = len(jax.tree.leaves(tree))
    if axis_name is None:
        return [None] * n
    if isinstance(axis_name, (str, PartitionSpec)) or (
        type(axis_name) is tuple and axis_name and all(isinstance(a, str) for a in axis_name)
    ):
        return [axis_name] * n

    def per_subtree(spec, subtree):
        return _LeafSpecs([spec] * len(jax.tree.leaves(subtree)))

    try:
        per_leaf = jax.tree.map(per_subtree, axis_name, tree, is_leaf=_is_spec_leaf)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`axis_name` must be a mesh axis name, a tuple of names, or a pytree of "
            "PartitionSpecs / names matching the updates (or a prefix of them, like "
            f"shard_map's `in_specs`); it does not match the updates: {error}"
        ) from None
    out = [spec for group in jax.tree.leaves(per_leaf) for spec in group.specs]
    if len(out) != n:
        raise ValueError(f"`axis_name` describes {len(out)} leaves but the updates have {n}.")
    return out


def leaf_mesh_axes(tree, axis_name) -> list[tuple]:
    """For each leaf of `tree` (in order), the sorted mesh axis names it is split over."""
    return [_spec_axes(spec) for spec in leaf_specs(tree, axis_name)]


def all_reduce_norm(norm, mesh_axes: tuple):
    """The 2-norms of pieces split over `mesh_axes` combined into the 2-norm of the whole.

    ``sqrt(psum(norm ** 2))``, with every piece divided by the largest first so that the squares
    cannot overflow. Elementwise: `norm` may be an array of norms (one per unit).
    """
    if not mesh_axes:
        return norm
    largest = lax.pmax(lax.stop_gradient(norm), mesh_axes)
    scale, inverse = power_of_two_scale(largest)
    total = lax.psum(jnp.square(norm * inverse), mesh_axes)
    return jnp.where(largest == jnp.inf, jnp.inf, scale * _root(total, 2.0))


def float_leaves(tree, what: str):
    """The leaves of `tree` as arrays, checked to be floating-point or complex."""
    paths_and_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in paths_and_leaves:
        _checks.check_float_leaf(path, leaf, what)
        leaves.append(jnp.asarray(leaf))
    return leaves


def global_norm_of(tree, p, axis_name, what: str):
    """The global `p`-norm of a checked tree (`p` already normalised by `_checks.check_ord`)."""
    leaves = float_leaves(tree, what)
    return tree_norm(leaves, leaf_mesh_axes(tree, axis_name), p)
