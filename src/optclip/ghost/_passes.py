"""The two ways `clipped_grad` computes a batch: ghost (``method="auto"``) and materialised
(``method="vmap"``). Each returns ``(clipped sum, per-example norms, losses, aux)``.

Both clip with optclip's scale (`_scale.clip_scale`: exact at any magnitude, 1 at a zero
gradient). An example is *kept* unless it is padding, or (with `nan_safe`) its norm is not
finite; a dropped example contributes exactly zero, a kept non-finite one makes the sum NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optclip import _per_example, _scale
from optclip.ghost import _factors, _interpret, _leaves, _sums, _trace


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `clipped_grad` was asked for, checked."""

    argnums: Any
    argnum_tuple: tuple
    axes: tuple
    l2_clip_norm: Any
    rescale_to_unit_norm: bool
    nan_safe: bool
    dtype: Any
    pre_clipping_transform: Any
    spmd_axis_name: Any


def weights(norms, padding, s: Settings):
    """Each example's factor in the clipped sum (0 for a dropped example) and which examples
    are kept."""
    threshold = _scale.threshold_as(s.l2_clip_norm, norms.dtype)
    scale = _scale.clip_scale(norms, threshold)
    if s.rescale_to_unit_norm:
        unit = jnp.where(norms > 0, 1 / jnp.where(norms > 0, norms, 1), 0)
        scale = jnp.where(threshold > 0, scale / jnp.where(threshold > 0, threshold, 1), unit)
    finite = jnp.isfinite(norms)
    keep = ~padding & (finite | (not s.nan_safe))
    return jnp.where(keep, scale, 0), keep, finite


def _vmap(fun, in_axes, s: Settings):
    return jax.vmap(fun, in_axes=in_axes, spmd_axis_name=s.spmd_axis_name)


def vmap_pass(one, args, kwargs, padding, s: Settings):
    """Per-example gradients materialised (`jax.vmap` of `jax.grad`), clipped and summed by
    `_per_example` (the reference)."""

    def value_and_grad(*a):
        return jax.value_and_grad(lambda *p: one(p, a[-1]), argnums=s.argnums, has_aux=True)(
            *a[:-1]
        )

    (losses, aux), grads = _vmap(value_and_grad, (*s.axes, 0), s)(*args, kwargs)
    if s.pre_clipping_transform is not None:
        grads = _vmap(s.pre_clipping_transform, 0, s)(grads)
    if s.dtype is not None:
        grads = jax.tree.map(lambda g: g.astype(s.dtype), grads)
    leaves, treedef = jax.tree.flatten(grads)
    if leaves:
        norms = _per_example.example_norms(leaves, per_leaf=False)
    else:  # (no parameters: every example's gradient is empty, of norm 0, as the ghost way's)
        norms = jnp.zeros(jnp.shape(losses)[:1], jnp.float32)
    w, keep, _ = weights(norms, padding, s)
    sums = _per_example._sums(leaves, lambda i: w, keep, "zero")
    return jax.tree.unflatten(treedef, sums), norms, losses, aux


@dataclasses.dataclass
class Flat:
    """The leaves of ``(args, kwargs)`` the loss is traced with (`leaves`, arrays), per leaf
    whether it is a parameter and whether it is batched, and `rebuild`, which gives
    ``(args, kwargs)`` back from such leaves with the static ones (Python numbers and bools
    that are neither differentiated nor batched, left as they are: as `jax.vmap` does, so that
    ``if flag:`` in the loss works) put back."""

    leaves: list
    params: list
    batched: list
    rebuild: Any
    static: list  # per leaf of ``(args, kwargs)``, whether it is left as it is


def flatten(args, kwargs, s: Settings) -> Flat:
    flat, tree = jax.tree.flatten((args, kwargs))
    params, batched = [], []
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        params += [i in s.argnum_tuple] * count
        batched += [s.axes[i] == 0] * count
    count = len(jax.tree.leaves(kwargs))
    params += [False] * count
    batched += [True] * count
    array = (jax.Array, np.ndarray, np.generic)
    static = [not (p or b or isinstance(x, array)) for x, p, b in zip(flat, params, batched)]

    def rebuild(leaves):
        leaves = iter(leaves)
        full = [x if st else next(leaves) for x, st in zip(flat, static, strict=True)]
        return jax.tree.unflatten(tree, full)

    keep = [i for i, st in enumerate(static) if not st]
    leaves = [flat[i] if isinstance(flat[i], jax.Array) else jnp.asarray(flat[i]) for i in keep]
    return Flat(leaves, [params[i] for i in keep], [batched[i] for i in keep], rebuild, static)


def one_example(flat: Flat) -> list:
    """The shapes and dtypes of one example's `flat.leaves`."""
    return [
        jax.ShapeDtypeStruct(x.shape[1:] if b else x.shape, x.dtype)
        for x, b in zip(flat.leaves, flat.batched, strict=True)
    ]


def flat_loss(one, flat: Flat):
    """One example's loss `one` as a function of `flat.leaves` (one example's)."""
    return lambda *leaves: one(*flat.rebuild(leaves))


def trace(one, flat: Flat):
    """The closed jaxpr of one example's loss, its output shapes and its `_trace.Plan`."""
    shared = [  # (the arguments the same for every example: neither batched nor differentiated)
        None if b or p else x
        for x, b, p in zip(flat.leaves, flat.batched, flat.params, strict=True)
    ]
    return _trace.trace(flat_loss(one, flat), one_example(flat), flat.params, shared)


def batch_axis_spec(like):
    """The mesh axis (or axes) `like`'s leading axis is split over, in JAX's explicit sharding
    mode; else None."""
    sharding = getattr(jax.typeof(like), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec[0] if spec else None


def batch_zeros(one, like, axis: int = 0):
    """Zeros of `one`'s shape and dtype for every example, the example axis at `axis`, split
    over the mesh like the batch `like` (explicit sharding refuses to `vmap` differently split
    inputs together)."""
    shape = (*one.shape[:axis], like.shape[0], *one.shape[axis:])
    split = batch_axis_spec(like)
    if split is None:
        return jnp.zeros(shape, one.dtype)
    spec = jax.sharding.PartitionSpec(*([None] * axis), split)
    return jnp.zeros(shape, one.dtype, out_sharding=spec)


def tapped_pass(one, flat: Flat, s: Settings) -> _interpret.Tapped:
    """One forward pass and one backward pass, to the taps at the ghost leaves' sites and to a
    per-example copy of every materialised leaf (no weight gradient is formed)."""
    closed, out_shape, plan = trace(one, flat)
    where = [i for i, p in enumerate(flat.params) if p]  # each parameter leaf in flat.leaves
    leaves = [flat.leaves[i] for i in where]
    plans = _leaves.plan_leaves(list(plan.all_sites()), len(leaves))
    sites = _leaves.ghost_sites(plans)
    own = {where[k] for k in _leaves.materialised(plans)}  # (each example's copy, `deltas`)
    _trace.mark_batched(plan, closed.jaxpr, [b or i in own for i, b in enumerate(flat.batched)])
    first = next(x for x, b in zip(flat.leaves, flat.batched, strict=True) if b)
    depth = {i: len(site.stack) for i, site in sites.items()}
    taps = {
        i: tuple(batch_zeros(t, first, depth[i]) for t in shapes)
        for i, shapes in _interpret.tap_shapes(sites).items()
    }
    deltas = {k: batch_zeros(leaves[k], first) for k in _leaves.materialised(plans)}

    def single(flat_leaves, taps, deltas):
        flat_leaves = list(flat_leaves)
        for k, delta in deltas.items():  # each example's own copy of a materialised leaf
            flat_leaves[where[k]] = flat_leaves[where[k]] + delta
        records: dict = {}
        outs = _interpret.run(closed.jaxpr, closed.consts, flat_leaves, plan, taps, records)
        return outs, records

    in_axes = [0 if b else None for b in flat.batched]
    tap_axes = {i: (depth[i],) * len(t) for i, t in taps.items()}
    record_axes = {key: depth[i] for i, site in sites.items() for key in site.records}
    mapped = jax.vmap(
        single,
        in_axes=(in_axes, tap_axes, 0),
        out_axes=(0, record_axes),
        spmd_axis_name=s.spmd_axis_name,
    )

    def total(taps, deltas):
        outs, records = mapped(flat.leaves, taps, deltas)
        return jnp.sum(outs[0]), (outs, records)

    (grads, example_grads), (outs, records) = jax.grad(total, (0, 1), has_aux=True)(taps, deltas)
    losses, aux = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    axes = {"records": record_axes, "grads": depth}  # where each one's examples are
    t = _interpret.Tapped(losses, aux, records, grads, example_grads, plans, leaves, axes)
    if _sums.without_cond(t):  # (nothing asks the records for another layout)
        return t
    grads = convolutions_row_major(grads, sites)
    return dataclasses.replace(t, records=row_major(records), grads=grads)


def row_major(tree):
    """`tree` (the records, or output gradients), its arrays with an axis of length 1 pinned to
    the row-major layout on a CPU, for a step with `cond`s (not `_sums.without_cond`).

    Where an axis has length 1, layouts that place it differently are the same bytes, and XLA's
    CPU layout assignment may give an array one of them (the batch's input ``(B, 1, 784)`` got
    its unit axis outermost) while the products inside the `cond`s that read it (the norms',
    the clipped sums') ask for another: each branch then holds a copy of it, at the step's peak
    (the MLP at batch 256: 1.24x the non-private step's memory, 1.14x with its records pinned).
    Arrays without a unit axis are left to XLA (pinning one could force a transpose)."""
    leaves, structure = jax.tree.flatten(tree)
    loose = {k: x for k, x in enumerate(leaves) if x.ndim > 1 and 1 in x.shape}
    if not loose:
        return tree

    def pinned():
        return {k: _interpret.in_row_major(x) for k, x in loose.items()}

    loose = lax.platform_dependent(cpu=pinned, default=lambda: loose)
    return jax.tree.unflatten(structure, [loose.get(k, x) for k, x in enumerate(leaves)])


def convolutions_row_major(grads: dict, sites: dict) -> dict:
    """The output gradients `grads` (``{site id: tuple}``), the convolution sites' pinned as
    the records are (`row_major`): XLA's CPU layout assignment gave a convolution's ``(B, 1, H,
    W, C)`` output gradient its examples' axis inside the unit one, and the `cond`s' branches
    each copied it (the benchmark's convnet at 64: 1.38x the non-private step's memory, 1.15x
    pinned). No other output gradient was found copied (the MLP's, the transformer's), and
    pinning one makes XLA write it out where it had fused its producer into its readers (the
    MLP at 16: ten more fusions, 1.03-1.04x the time), so only the convolutions' are."""
    convs = {i: g for i, g in grads.items() if sites[i].kind == "conv"}
    return {**grads, **row_major(convs)}


def ghost_pass(one, args, kwargs, padding, s: Settings):
    """Ghost norms, then the clipped sum by book-keeping (`_sums`): from the same records and
    output gradients, with no second pass."""
    t = tapped_pass(one, flatten(args, kwargs, s), s)
    terms, sides = _leaves.leaf_norm_terms(t)
    norms = _factors.combine(terms) if terms else jnp.zeros((t.size,), jnp.float32)
    w, keep, finite = weights(norms, padding, s)
    sums = _sums.clipped_sums(t, w, keep, finite, sides, s.spmd_axis_name)
    sums = _sums.unused_as_weighted(t, sums, w, keep)
    if s.dtype is not None:
        sums = [g.astype(s.dtype) for g in sums]
    return _as_grads(sums, args, s), norms, t.losses, t.aux


def _as_grads(leaves, args, s: Settings):
    """The differentiated arguments' trees (a tuple of them for a sequence `argnums`) with
    `leaves` (theirs in positional order)."""
    trees, start = {}, 0
    for i in sorted(s.argnum_tuple):
        treedef = jax.tree.structure(args[i])
        count = len(jax.tree.leaves(args[i]))
        trees[i] = jax.tree.unflatten(treedef, leaves[start : start + count])
        start += count
    if isinstance(s.argnums, int):
        return trees[s.argnums]
    return tuple(trees[i] for i in s.argnum_tuple)
