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
* Groups: the partial sums of the leaves are collected into buckets (one per group of leaves,
  for per-layer norms) before they are combined, so group norms cost no second pass.
* Devices: partial sums of leaves split over mesh axes are all-reduced (`psum`, or `pmax` for the
  infinity norm) over exactly those axes, once per distinct set of axes; replicated leaves are
  counted once. Eager leaves committed to different devices are reduced where they are and their
  partial sums brought together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from optclip import _axes, _checks

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


def _part_magnitude(x):
    """``max(|re|, |im|)`` elementwise in `x`'s own dtype (``|x|`` for real `x`): within a factor
    sqrt(2) of ``|x|``, which is all a scale needs, and its maximum is exact in the leaf's dtype
    (so it is taken there and only the result is converted)."""
    if jnp.iscomplexobj(x):
        return jnp.maximum(jnp.abs(jnp.real(x)), jnp.abs(jnp.imag(x)))
    return jnp.abs(x)


def _magnitude(x):
    """``|x|`` elementwise (exact for complex, with a finite gradient at zero)."""
    if not jnp.iscomplexobj(x):
        return jnp.abs(x)
    z = x.astype(jnp.promote_types(x.dtype, jnp.complex64))
    nonzero = z != 0
    return jnp.where(nonzero, jnp.abs(jnp.where(nonzero, z, 1)), 0)


def _sum(a, axis):
    return jnp.sum(a, axis=axis)


def _max(a, axis):
    return jnp.max(a, axis=axis, initial=0)


def _needs_rescale(total, p, zero_is_exact: bool):
    """Where a plain sum of powers lost the norm: it overflowed or underflowed (elementwise).

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


def _safe_norm(total, p, largest: Callable, rescaled_total: Callable, needs):
    """The norms from plain sums of powers `total`, or, where `needs` says a sum lost its norm,
    from rescaled ones.

    `largest()` gives the largest magnitudes and `rescaled_total(inverse_scale)` the sums of
    ``|x * inverse_scale| ** p`` (both shaped like `total`); they are only evaluated when some
    plain sum overflowed or underflowed.
    """

    def plain():
        return _root(total, p)

    def rescaled():
        return _rescaled_norm(largest, rescaled_total, p).astype(total.dtype)

    needs_rescale = jnp.any(needs)
    if not isinstance(needs_rescale, jax.core.Tracer):
        # Eager: decide in Python rather than trace and compile a `cond` on every call.
        return rescaled() if bool(needs_rescale) else plain()
    return lax.cond(needs_rescale, rescaled, plain)


def _norm_with_rules(arrays, p, reduce, largest, expand, needs_rescale, rules: bool = True):
    """The `p`-norms of `arrays` (a list), with a batching rule and a differentiation rule.

    The norms may come in several "views" of the same arrays (per group of leaves, and of all of
    them), each a reduction of the same elementwise terms:

    * `reduce(terms)` reduces `terms[v][i]`, the elementwise terms of ``arrays[i]`` for view
      `v`, into the norms' shape (over some axes of one leaf; per group of leaves and then all
      of them);
    * `largest(arrays)` is the largest magnitude, reduced the same way;
    * `expand(values, i, array)` is, for each view, norm-shaped `values` broadcast against
      ``arrays[i]`` (a list, one entry per view);
    * `needs_rescale(total)` says, norm by norm, where a plain sum lost its norm.

    The norms themselves are `_safe_norm`'s. Two custom rules (with `rules`, for a static order
    and no collectives):

    * `vmap` (per-example clipping): a `lax.cond` with a batched predicate would become a
      `select` running both branches for every example; the rule keeps one `cond`, on whether
      any example needs the fallback.
    * differentiation: `d||x||_p = sum((|x|/n)**(p-2) * (x/n) * dx)`, with `x/n` computed with a
      power-of-two scale (no overflow, no flush to zero); zero at `n == 0`. This is the exact
      derivative of the norm, whichever branch computed it.
    """

    def totals(arrays, inverse_scale=None):
        if inverse_scale is None:
            plain = [magnitude_power(a, p) for a in arrays]  # shared by every view
            return reduce([plain] * len(expand(None, None, None)))
        per_array = [
            [magnitude_power(a, p, s) for s in expand(inverse_scale, i, a)]
            for i, a in enumerate(arrays)
        ]
        return reduce([list(view) for view in zip(*per_array)])

    def compute(arrays):
        total = totals(arrays)
        return _safe_norm(
            total,
            p,
            lambda: largest(arrays),
            lambda inv: totals(arrays, inv),
            needs_rescale(total),
        )

    if not rules or not any(isinstance(a, jax.core.Tracer) for a in arrays):
        return compute(arrays)  # eager (no transformation to write rules for), or collectives

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
        needs = jax.vmap(needs_rescale)(total)

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
        per_array = [
            [_norm_tangent(a, da, n_view, p) for n_view in expand(n, i, a)]
            for i, (a, da) in enumerate(zip(arrays, darrays))
        ]
        return n, reduce([list(view) for view in zip(*per_array)])

    return norm(arrays)


def _norm_tangent(x, dx, n, p: float):
    """Elementwise terms of the derivative of the `p`-norm `n` of `x` in the direction `dx`
    (`n` broadcasts against `x`)."""
    n_safe = jnp.where((n == 0) | ~jnp.isfinite(n), 1, n)
    _, inverse = power_of_two_scale(n_safe)
    n_scaled = n_safe * inverse  # in [0.5, 1): dividing by it is safe
    ratio = [c * inverse.astype(c.dtype) / n_scaled.astype(c.dtype) for c in _parts(x)]
    directional = sum(r * d for r, d in zip(ratio, _parts(jnp.asarray(dx, x.dtype))))
    if p != 2.0:
        magnitude = jnp.abs(ratio[0]) if len(ratio) == 1 else jnp.hypot(*ratio)
        directional = _pow0(magnitude, p - 2) * directional
    return jnp.where(n == 0, 0, directional).astype(n.dtype)


def leaf_norm(x, p: float = 2.0, axes=None):
    """The `p`-norm of one array, over `axes` (kept as size-1 dimensions) or over all of it.

    `axes` must already be normalised (a tuple of non-negative ints) or None.
    """
    keepdims = axes is not None
    if p == math.inf:
        magnitude = _magnitude(x)
        return jnp.max(magnitude, axis=axes, keepdims=keepdims, initial=0).astype(
            jnp.promote_types(magnitude.dtype, accum_dtype(x.dtype))
        )
    acc = accum_dtype(x.dtype)
    return _norm_with_rules(
        [x],
        p,
        reduce=lambda terms: jnp.sum(terms[0][0], axis=axes, keepdims=keepdims),
        largest=lambda arrays: jnp.max(
            _part_magnitude(arrays[0]), axis=axes, keepdims=keepdims, initial=0
        ).astype(acc),
        expand=lambda values, i, array: [values],
        needs_rescale=lambda total: _needs_rescale(total, p, zero_is_exact=True),
    )


# ----------------------------------------------------------------------------------------------
# Norms over many leaves, in groups ("buckets"), possibly split over mesh axes or on several
# devices.


def _sharding_key(x):
    try:
        return jax.typeof(x).sharding
    except Exception:  # noqa: BLE001 - no sharding information: group by shape alone.
        return None


def placement(x):
    """The devices of a concrete array committed to them (eager code), else None."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or not x.committed:
        return None
    return frozenset(x.sharding.device_set)


def on_devices_of(value, x):
    """The concrete `value` (a scale) placed on the devices of the concrete committed array `x`
    (replicated there), so that eager leaves on different devices are each scaled where they
    are."""
    where, here = placement(x), placement(value)
    if where is None or here is None or where == here:
        return value
    sharding = x.sharding
    if len(where) == 1:
        target = jax.sharding.SingleDeviceSharding(next(iter(where)))
    elif isinstance(sharding, NamedSharding):
        target = NamedSharding(sharding.mesh, PartitionSpec())
    else:
        return value
    return jax.device_put(value, target)


class _Piece(NamedTuple):
    """What the norm reduces: one leaf, or a stack of small leaves along a new leading axis."""

    array: jax.Array
    leaves: tuple  # the indices of the leaves in `array` (one if not stacked)
    axes: tuple  # the mesh axes it is split over
    place: frozenset | None  # its devices, for eager arrays committed to them


class _View(NamedTuple):
    """One way of collecting the leaves' partial sums: into `count` buckets, leaf i into
    ``buckets[i]`` (the groups of `group_norms`, or one bucket for the global norm)."""

    buckets: tuple
    count: int
    offset: int  # where this view's norms start in the vector of every view's norms

    def ids(self, piece) -> tuple:
        return tuple(self.buckets[i] for i in piece.leaves)

    def expand(self, values, piece, a):
        """This view's part of `values` (every view's norms) broadcast against `a`, the piece's
        array: one value for the piece, or one per leaf of a stack over several buckets."""
        values = values[self.offset : self.offset + self.count]
        ids = self.ids(piece)
        if len(set(ids)) == 1:
            return on_devices_of(values[ids[0]], a)
        v = values[np.asarray(ids)]
        return on_devices_of(v.reshape(v.shape + (1,) * (a.ndim - 1)), a)


def _views(buckets: tuple, n: int) -> list[_View]:
    """The global norm's view of `n` leaves (one bucket), after the groups' view if there are
    groups."""
    everything = _View((0,) * n, 1, 0)
    if not buckets:
        return [everything]
    count = max(buckets) + 1
    return [_View(buckets, count, 0), everything._replace(offset=count)]


def _stack_leaves(leaves, leaf_axes) -> list[_Piece]:
    """The pieces to reduce: big leaves alone, small ones stacked with their like (shape, dtype,
    mesh axes, sharding, devices), at most `STACK_CHUNK` to a stack.

    Every element of every leaf is in exactly one piece. Stacking comes first, before any
    elementwise work, so that the norm's program has a few operations per stack rather than a
    few per leaf (with 2000 leaves, that is the difference between ~1 s and ~1 min of
    compilation on CPU). Leaves of different groups share stacks: a stack is then reduced leaf
    by leaf, still in one operation.
    """
    pieces, groups = [], {}
    for index, (x, axes) in enumerate(zip(leaves, leaf_axes)):
        place = placement(x)
        if x.size > STACK_MAX_SIZE:
            pieces.append(_Piece(x, (index,), axes, place))
            continue
        key = (x.shape, x.dtype, axes, _sharding_key(x), place)
        groups.setdefault(key, []).append(index)
    for (_, _, axes, _, place), indices in groups.items():
        for start in range(0, len(indices), STACK_CHUNK):
            chunk = tuple(indices[start : start + STACK_CHUNK])
            array = leaves[chunk[0]] if len(chunk) == 1 else jnp.stack([leaves[i] for i in chunk])
            pieces.append(_Piece(array, chunk, axes, place))
    return pieces


def _segment(values, ids, count: int, how: str):
    """`values` summed (or maxed) into `count` buckets by the static `ids`."""
    if count == 1:
        return jnp.sum(values, keepdims=True) if how == "sum" else jnp.max(values, keepdims=True)
    if len(ids) == count and np.array_equal(np.sort(ids), np.arange(count)):
        return values[np.argsort(ids)]  # one leaf a bucket: a static permutation
    if how == "sum":
        return jax.ops.segment_sum(values, jnp.asarray(ids), count)
    return jnp.maximum(jax.ops.segment_max(values, jnp.asarray(ids), count), 0)


def _per_leaf(piece, a, reducer):
    """`a` (a piece's array after elementwise work) reduced leaf by leaf: shape (k,) for a stack
    of k leaves, (1,) for a single leaf."""
    if len(piece.leaves) > 1:
        return reducer(a, tuple(range(1, a.ndim)))
    return reducer(a, None).reshape(1)


def _reduce_buckets(pieces, views, terms, reducer, how: str, dtype):
    """Every view's buckets: `terms[v][i]` (piece i's array after elementwise work for view `v`)
    reduced leaf by leaf with `reducer` (`_sum` or `_max`), and these partials collected into
    view `v`'s buckets; the views' vectors concatenated. Views given the same terms (the plain
    sums) share one reduction: the group norms and the global norm come from the same partials,
    with no second pass over the leaves, and the global norm is the same with or without groups.

    Then combined across devices: all-reduced (`psum`, or `pmax` for "max") over the mesh axes
    each piece is split over, once per distinct set of axes for all views together; eager pieces
    on different devices are brought to one device first.
    """
    by_place: dict = {}
    for i, piece in enumerate(pieces):
        by_place.setdefault((piece.axes, piece.place), []).append(i)
    results = []
    for (axes, _), members in by_place.items():
        vectors, partials = [], {}
        for view, view_terms in zip(views, terms):
            if id(view_terms) not in partials:
                parts = [_per_leaf(pieces[i], view_terms[i], reducer) for i in members]
                parts = [v.astype(dtype) for v in parts]
                vector = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
                # Without the barrier XLA turns `sum(reduce(x, leaf by leaf))` back into a
                # reduction of `x`, which then runs once for the global norm and once for the
                # groups; with it, every view sums the same partials, computed once.
                partials[id(view_terms)] = lax.optimization_barrier(vector)
            ids = np.concatenate([np.asarray(view.ids(pieces[i]), np.int32) for i in members])
            vectors.append(_segment(partials[id(view_terms)], ids, view.count, how))
        vector = vectors[0] if len(vectors) == 1 else jnp.concatenate(vectors)
        if axes:
            vector = lax.psum(vector, axes) if how == "sum" else lax.pmax(vector, axes)
        results.append(vector)
    if len({place for _, place in by_place}) > 1:
        results = [jax.device_put(r, results[0].sharding) for r in results]
    stacked = jnp.stack(results) if len(results) > 1 else results[0][None]
    return jnp.sum(stacked, axis=0) if how == "sum" else jnp.max(stacked, axis=0)


def _needs_rescale_views(total, p, views):
    """Buckets whose plain sum lost the norm; every bucket if the global sum did. An exactly
    zero group is trusted (a frozen layer must not send every step down the slow path); an
    exactly zero sum of everything is not."""
    overall = _needs_rescale(total[-1], p, zero_is_exact=False)
    if len(views) == 1:
        return overall[None] if overall.ndim == 0 else overall
    return _needs_rescale(total, p, zero_is_exact=True) | overall


def _norms_for_order(pieces, views, p, dtype):
    """Every view's norms, one vector (the global norm last), for an order `p` (static, or
    traced in one branch of `_norms_traced_order`)."""
    arrays = [piece.array for piece in pieces]
    if _is_static(p) and p == math.inf:
        magnitudes = [_magnitude(a) for a in arrays]
        return _reduce_buckets(pieces, views, [magnitudes] * len(views), _max, "max", dtype)

    def expand(values, i, a):
        if values is None:
            return views  # (only its length is used: how many views)
        return [view.expand(values, pieces[i], a) for view in views]

    def largest(arrays):
        magnitudes = [_part_magnitude(a) for a in arrays]
        return _reduce_buckets(pieces, views, [magnitudes] * len(views), _max, "max", dtype)

    return _norm_with_rules(
        arrays,
        p,
        reduce=lambda terms: _reduce_buckets(pieces, views, terms, _sum, "sum", dtype),
        largest=largest,
        expand=expand,
        needs_rescale=lambda total: _needs_rescale_views(total, p, views),
        # Inside shard_map/pmap (collectives) or for a traced order: JAX's own autodiff and
        # batching of the `cond` (correct; the fallback's scale carries no gradient).
        rules=_is_static(p) and not any(piece.axes for piece in pieces),
    )


def _norms_traced_order(pieces, views, p, dtype):
    """The norms for an order known only at run time (`inject_hyperparams`): one branch runs."""
    p = jnp.asarray(p).astype(dtype)
    index = jnp.where(
        p == 2, 0, jnp.where(p == 1, 1, jnp.where(p == jnp.inf, 2, jnp.where(p > 0, 3, 4)))
    )
    size = sum(view.count for view in views)
    branches = [
        lambda: _norms_for_order(pieces, views, 2.0, dtype),
        lambda: _norms_for_order(pieces, views, 1.0, dtype),
        lambda: _norms_for_order(pieces, views, math.inf, dtype),
        lambda: _norms_for_order(pieces, views, p, dtype),
        lambda: jnp.full((size,), jnp.nan, dtype),  # an order that is not > 0
    ]
    return lax.switch(index, branches)


def tree_norms(leaves: Sequence, leaf_axes: Sequence[tuple], p, buckets: Sequence[int] = ()):
    """``(global norm, bucket norms)`` of `leaves`: the `p`-norm of all of them together, and of
    each bucket of them (`buckets[i]` is leaf i's, numbered from 0; without `buckets`, the
    bucket norms are just the global norm, shape (1,)).

    `leaf_axes[i]` are the mesh axes leaf i is split over; `p` is a Python float from
    `_checks.check_ord`, or a traced order. The bucket norms come from the same partial sums as
    the global norm (no second pass over the leaves), and the global norm is the same, bit for
    bit, with or without buckets.
    """
    buckets = tuple(buckets)
    views = _views(buckets, len(leaves))
    dtype = widest_accum_dtype([x.dtype for x in leaves])
    if not leaves:
        return jnp.zeros((), dtype), jnp.zeros((views[0].count,), dtype)
    pieces = _stack_leaves(leaves, leaf_axes)
    if _is_static(p):
        norms = _norms_for_order(pieces, views, p, dtype)
    else:
        norms = _norms_traced_order(pieces, views, p, dtype)
    return norms[-1], norms[: views[0].count]


def tree_norm(leaves: Sequence, leaf_axes: Sequence[tuple], p):
    """The `p`-norm of all `leaves` together (see `tree_norms`)."""
    return tree_norms(leaves, leaf_axes, p)[0]


# ----------------------------------------------------------------------------------------------
# Norms across devices, and the entry points.


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


def norms_of(tree, p, axis_name, what: str, buckets: Sequence[int] = ()):
    """``(global norm, bucket norms)`` of a checked tree (`p` from `_checks.check_ord`), reduced
    over the mesh axes `axis_name` gives or JAX's tracking infers (`_axes.leaf_axes`)."""
    leaves = float_leaves(tree, what)
    return tree_norms(leaves, _axes.leaf_axes(tree, axis_name, what), p, buckets)


def global_norm_of(tree, p, axis_name, what: str):
    """The global `p`-norm of a checked tree (see `norms_of`)."""
    return norms_of(tree, p, axis_name, what)[0]
