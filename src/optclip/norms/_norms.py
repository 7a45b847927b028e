"""The norm of leaves and trees: one routine serves every clipping mode.

The elementwise terms, the overflow/underflow fallback and the batching and differentiation
rules are `_reductions`'; this module decides what is reduced together:

* Many leaves: small leaves of one shape, dtype and sharding are stacked and reduced together, so
  compile time does not grow with one kernel per leaf.
* Groups: the partial sums of the leaves are collected into buckets (one per group of leaves,
  for per-layer norms) before they are combined, so group norms cost no second pass. A leaf that
  stacks layers (``stacked=``) is reduced over all axes but its layer axis: one partial sum per
  layer, each collected into its layer's bucket.
* Devices: partial sums of leaves split over mesh axes are all-reduced (`psum`, or `pmax` for the
  infinity norm) over exactly those axes, once per distinct set of axes; replicated leaves are
  counted once. Eager leaves committed to different devices are reduced where they are and their
  partial sums brought together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from optclip import _checks
from optclip.norms import _axes, _groups, _layers, _places, _reductions
from optclip.norms._reductions import accum_dtype, max_over, nan_count_over, sum_over

# Leaves with at most this many elements are stacked with others of their shape before reducing.
STACK_MAX_SIZE = 1 << 14
# At most this many leaves go into one stack (XLA compiles huge concatenations slowly).
STACK_CHUNK = 128


def leaf_norm(x, p: float = 2.0, axes=None, zero_is_exact: bool = False):
    """The `p`-norm of one array, over `axes` (kept as size-1 dimensions) or over all of it.

    `axes` must already be normalised (a tuple of non-negative ints) or None. With
    `zero_is_exact`, a slice whose sum of powers is exactly zero is trusted (see
    `_reductions.needs_rescale`): where zero rows are common and the caller knows that 0 and
    the exact norm lead to the same result.
    """
    if _places.compiled_here([x]):
        return _leaf_norm_compiled(x, p, axes, zero_is_exact)
    keepdims = axes is not None
    if p == math.inf:
        magnitude = _reductions.magnitude(x)
        norm = _reductions.leaf_max_norm(magnitude, axes, keepdims)
        return norm.astype(jnp.promote_types(magnitude.dtype, accum_dtype(x.dtype)))
    acc = accum_dtype(x.dtype)
    count = math.prod(x.shape[a] for a in axes) if axes is not None else x.size
    return _reductions.norm_with_rules(
        [x],
        p,
        reduce=lambda terms: jnp.sum(terms[0][0], axis=axes, keepdims=keepdims),
        largest=lambda arrays: jnp.max(
            _reductions.part_magnitude(arrays[0]), axis=axes, keepdims=keepdims, initial=0
        ).astype(acc),
        expand=lambda values, i, array: [values],
        needs_rescale=lambda total: _reductions.needs_rescale(total, p, count, zero_is_exact),
    )


# ----------------------------------------------------------------------------------------------
# Norms over many leaves, in groups ("buckets"), across mesh axes and devices.


def _sharding_key(x):
    try:
        return jax.typeof(x).sharding
    except Exception:  # noqa: BLE001 - no sharding information: group by shape alone.
        return None


class _Piece(NamedTuple):
    """What the norm reduces: one leaf, or a stack of small leaves along a new leading axis."""

    array: jax.Array
    leaves: tuple  # the indices of the leaves in `array` (one if not stacked)
    axes: tuple  # the mesh axes it is split over
    place: frozenset | None  # its devices, for eager arrays committed to them
    layer_axis: int | None = None  # its leaves' layer axis (`stacked=`: a partial sum per layer)
    split: tuple = ()  # the mesh axes that split the layer axis (a device holds some layers)

    @property
    def layers(self) -> int:
        """The partial sums of each of its leaves: its layers here, or one."""
        if self.layer_axis is None:
            return 1
        return self.array.shape[self.layer_axis + (len(self.leaves) > 1)]


def _concat_ids(parts):
    if all(isinstance(x, np.ndarray) for x in parts):
        return np.concatenate(parts)
    return jnp.concatenate([jnp.asarray(x) for x in parts])


class _View(NamedTuple):
    """One way of collecting the leaves' partial sums: into `size` buckets, leaf i's into
    ``buckets[i]`` (the groups of `group_norms`, or one bucket for the global norm; for a leaf
    stacking layers, a tuple: one bucket per layer of the whole model)."""

    buckets: tuple
    size: int
    offset: int  # where this view's norms start in the vector of every view's norms

    def ids(self, piece):
        """The bucket of each partial sum of `piece`, leaf by leaf and layer by layer."""
        return _concat_ids(
            [_layers.bucket_ids(self.buckets[i], piece.layers, piece.split) for i in piece.leaves]
        )

    def expand(self, values, piece, a):
        """This view's part of `values` (every view's norms) broadcast against `a`, the piece's
        array: one value for the piece, or one per leaf of a stack and per layer of the leaves
        that stack layers."""
        values = values[self.offset : self.offset + self.size]
        ids = self.ids(piece)
        if isinstance(ids, np.ndarray) and np.all(ids == ids[0]):
            return _places.on_devices_of(values[ids[0]], a)
        shape = [1] * a.ndim
        several = len(piece.leaves) > 1
        if several:
            shape[0] = len(piece.leaves)
        if piece.layer_axis is not None:
            shape[piece.layer_axis + several] = piece.layers
        return _places.on_devices_of(values[ids].reshape(shape), a)


def _views(buckets: tuple, n: int) -> list[_View]:
    """The global norm's view of `n` leaves (one bucket), after the groups' view if any."""
    everything = _View((0,) * n, 1, 0)
    if not buckets:
        return [everything]
    count = 1 + max((max(b, default=0) if isinstance(b, tuple) else b for b in buckets), default=0)
    return [_View(buckets, count, 0), everything._replace(offset=count)]


def _stack_leaves(leaves, leaf_axes, layout) -> list[_Piece]:
    """The pieces to reduce: big leaves alone, small ones stacked with their like (shape, dtype,
    mesh axes, sharding, devices), at most `STACK_CHUNK` to a stack.

    Every element of every leaf is in exactly one piece. Stacking comes first, before any
    elementwise work, so that the norm's program has a few operations per stack rather than a
    few per leaf, which XLA compiles slowly when there are thousands of leaves. Leaves of
    different groups share stacks: a stack is then reduced leaf by leaf, still in one
    operation. Leaves that stack layers (`layout.layer_axes`) are stacked only with leaves of
    the same layer axis and split.
    """
    pieces: list[_Piece] = []
    groups: dict[tuple, list[int]] = {}
    for index, (x, axes) in enumerate(zip(leaves, leaf_axes)):
        place = _places.placement(x)
        layer_axis, split = layout.layer_axes[index], layout.splits[index]
        if x.size > STACK_MAX_SIZE:
            pieces.append(_Piece(x, (index,), axes, place, layer_axis, split))
            continue
        key = (x.shape, x.dtype, axes, _sharding_key(x), place, layer_axis, split)
        groups.setdefault(key, []).append(index)
    for (_, _, axes, _, place, layer_axis, split), indices in groups.items():
        for start in range(0, len(indices), STACK_CHUNK):
            chunk = tuple(indices[start : start + STACK_CHUNK])
            array = leaves[chunk[0]] if len(chunk) == 1 else jnp.stack([leaves[i] for i in chunk])
            pieces.append(_Piece(array, chunk, axes, place, layer_axis, split))
    return pieces


def _segment(values, ids, count: int, how: str):
    """`values` summed (or maxed) into `count` buckets by the static `ids`."""
    if count == 1:
        return jnp.sum(values, keepdims=True) if how == "sum" else jnp.max(values, keepdims=True)
    static = isinstance(ids, np.ndarray)
    if static and len(ids) == count and np.array_equal(np.sort(ids), np.arange(count)):
        return values[np.argsort(ids)]  # one leaf a bucket: a static permutation
    if how == "sum":
        return jax.ops.segment_sum(values, jnp.asarray(ids), count)
    return jnp.maximum(jax.ops.segment_max(values, jnp.asarray(ids), count), 0)


def _replicated(x):
    """`x` replicated over its mesh if it is sharded over explicit mesh axes (the partial sums of
    a leaf whose layer axis is sharded): JAX would not concatenate it with other partial sums."""
    sharding = _sharding_key(x)
    if not isinstance(sharding, NamedSharding) or all(entry is None for entry in sharding.spec):
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))


def _per_leaf(piece, a, reducer):
    """`a` (a piece's array after elementwise work) reduced leaf by leaf, and layer by layer for
    leaves that stack layers: shape (k * layers,) for a stack of k leaves."""
    keep = (0,) if len(piece.leaves) > 1 else ()
    if piece.layer_axis is not None:
        keep += (piece.layer_axis + len(keep),)
    if not keep:
        return reducer(a, None).reshape(1)
    partials = reducer(a, tuple(d for d in range(a.ndim) if d not in keep))
    return _replicated(partials).reshape(-1)


def _reduce_buckets(pieces, views, terms, reducer, how: str, dtype):
    """Every view's buckets: `terms[v][i]` (piece i's array after elementwise work for view `v`)
    reduced leaf by leaf with `reducer` (`sum_over` or `max_over`), and these partials collected
    into view `v`'s buckets; the views' vectors concatenated. Views given the same terms (the plain
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
            ids = _concat_ids([view.ids(pieces[i]) for i in members])
            vectors.append(_segment(partials[id(view_terms)], ids, view.size, how))
        vector = vectors[0] if len(vectors) == 1 else jnp.concatenate(vectors)
        if axes:
            vector = lax.psum(vector, axes) if how == "sum" else lax.pmax(vector, axes)
        results.append(vector)
    if len({place for _, place in by_place}) > 1:
        results = [jax.device_put(r, results[0].sharding) for r in results]
    stacked = jnp.stack(results) if len(results) > 1 else results[0][None]
    return jnp.sum(stacked, axis=0) if how == "sum" else jnp.max(stacked, axis=0)


def _counts(pieces, views):
    """How many elements each of every view's sums adds up (the vector's layout, the global
    norm last): what bounds the powers it may have lost to underflow. Where a device's buckets
    are known only at run time (a layer axis split inside `shard_map`), every bucket is
    bounded by the whole count, which is larger."""
    whole = sum(piece.array.size for piece in pieces)
    counts = []
    for view in views:
        count = np.zeros(view.size, np.int64)
        for piece in pieces:
            ids = view.ids(piece)
            if not isinstance(ids, np.ndarray):
                count[:] = whole
                break
            np.add.at(count, ids, piece.array.size // max(len(ids), 1))
        counts.append(count)
    return np.concatenate(counts)


def _needs_rescale_views(total, p, views, counts):
    """Buckets whose plain sum lost the norm; every bucket if the global sum did (`counts`
    from `_counts`). An exactly zero group is trusted (a frozen layer must not send every step
    down the slow path); an exactly zero sum of everything is not."""
    overall = _reductions.needs_rescale(total[-1], p, counts[-1], zero_is_exact=False)
    if len(views) == 1:
        return overall[None] if overall.ndim == 0 else overall
    return _reductions.needs_rescale(total, p, counts, zero_is_exact=True) | overall


def _norms_for_order(pieces, views, p, dtype):
    """Every view's norms, one vector (the global norm last), for an order `p` (static, or
    traced in one branch of `_norms_traced_order`)."""
    arrays = [piece.array for piece in pieces]
    if _reductions.is_static(p) and p == math.inf:
        magnitudes = [[_reductions.magnitude(a) for a in arrays]] * len(views)
        maxima = _reduce_buckets(pieces, views, magnitudes, max_over, "max", dtype)
        nans = _reduce_buckets(pieces, views, magnitudes, nan_count_over, "sum", dtype)
        return _reductions.max_norm(maxima, nans)
    counts = _counts(pieces, views)

    def expand(values, i, a):
        if values is None:
            return views  # (only its length is used: how many views)
        return [view.expand(values, pieces[i], a) for view in views]

    def largest(arrays):
        # (no gradient: only the fallback's scale comes from it, and `pmax` has no derivative)
        magnitudes = [_reductions.part_magnitude(lax.stop_gradient(a)) for a in arrays]
        return _reduce_buckets(pieces, views, [magnitudes] * len(views), max_over, "max", dtype)

    return _reductions.norm_with_rules(
        arrays,
        p,
        reduce=lambda terms: _reduce_buckets(pieces, views, terms, sum_over, "sum", dtype),
        largest=largest,
        expand=expand,
        needs_rescale=lambda total: _needs_rescale_views(total, p, views, counts),
        rules=_reductions.is_static(p),
        collectives=any(piece.axes for piece in pieces),
        acc=dtype,
    )


def _norms_traced_order(pieces, views, p, dtype):
    """The norms for an order known only at run time (`inject_hyperparams`): one branch runs."""
    p = jnp.asarray(p).astype(dtype)
    index = jnp.where(
        p == 2, 0, jnp.where(p == 1, 1, jnp.where(p == jnp.inf, 2, jnp.where(p > 0, 3, 4)))
    )
    size = sum(view.size for view in views)
    branches = [
        lambda: _norms_for_order(pieces, views, 2.0, dtype),
        lambda: _norms_for_order(pieces, views, 1.0, dtype),
        lambda: _norms_for_order(pieces, views, math.inf, dtype),
        lambda: _norms_for_order(pieces, views, p, dtype),
        lambda: jnp.full((size,), jnp.nan, dtype),  # an order that is not > 0
    ]
    return lax.switch(index, branches)


def tree_norms(leaves: Sequence, leaf_axes: Sequence[tuple], p, buckets=()):
    """``(global norm, bucket norms)`` of `leaves`: the `p`-norm of all of them together, and of
    each bucket of them (`buckets[i]` is leaf i's, numbered from 0; without `buckets`, the
    bucket norms are just the global norm, shape (1,)); or a `_groups.Layout`, where leaves that
    stack layers have a bucket per layer.

    `leaf_axes[i]` are the mesh axes leaf i is split over; `p` is a Python float from
    `_checks.check_ord`, or a traced order. The bucket norms come from the same partial sums as
    the global norm (no second pass over the leaves), and the global norm is the same, bit for
    bit, with or without buckets (given the same layer axes).
    """
    n = len(leaves)
    if not isinstance(buckets, _groups.Layout):
        buckets = _groups.Layout(tuple(buckets or ()), (None,) * n, ((),) * n)
    layout = buckets
    if _places.compiled_here(leaves) and _reductions.is_static(p):
        return _tree_norms_compiled(list(leaves), tuple(map(tuple, leaf_axes)), p, layout)
    views = _views(layout.buckets, n)
    dtype = _reductions.widest_accum_dtype([x.dtype for x in leaves])
    if not leaves:
        return jnp.zeros((), dtype), jnp.zeros((views[0].size,), dtype)
    pieces = _stack_leaves(leaves, leaf_axes, layout)
    if _reductions.is_static(p):
        norms = _norms_for_order(pieces, views, p, dtype)
    else:
        norms = _norms_traced_order(pieces, views, p, dtype)
    return norms[-1], norms[: views[0].size]


def tree_norm(leaves: Sequence, leaf_axes: Sequence[tuple], p):
    """The `p`-norm of all `leaves` together (see `tree_norms`)."""
    return tree_norms(leaves, leaf_axes, p)[0]


_leaf_norm_compiled = jax.jit(leaf_norm, static_argnums=(1, 2, 3))
_tree_norms_compiled = jax.jit(tree_norms, static_argnums=(1, 2, 3))


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
    scale, inverse = _reductions.power_of_two_scale(largest)
    total = lax.psum(jnp.square(norm * inverse), mesh_axes)
    return jnp.where(largest == jnp.inf, jnp.inf, scale * _reductions.root(total, 2.0))


def float_leaves(tree, what: str):
    """The leaves of `tree` as arrays, checked to be floating-point or complex."""
    paths_and_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in paths_and_leaves:
        _checks.check_float_leaf(path, leaf, what)
        leaves.append(jnp.asarray(leaf))
    return leaves


def norms_of(tree, p, axis_name, what: str, buckets: Sequence[int] | _groups.Layout | None = ()):
    """``(global norm, bucket norms)`` of a checked tree (`p` from `_checks.check_ord`), reduced
    over the mesh axes `axis_name` gives or JAX's tracking infers (`_axes.leaf_axes`)."""
    leaves = float_leaves(tree, what)
    return tree_norms(leaves, _axes.leaf_axes(tree, axis_name, what), p, buckets)


def global_norm_of(tree, p, axis_name, what: str):
    """The global `p`-norm of a checked tree (see `norms_of`)."""
    return norms_of(tree, p, axis_name, what)[0]
