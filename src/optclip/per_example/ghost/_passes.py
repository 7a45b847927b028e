"""The ghost pass of `clipped_grad` (``method="auto"``): the loss traced (`_trace`), each
leaf's route planned (`_plans`), one tapped forward and backward pass (`tapped_pass`), then the
norms and the clipped sums (`finish`). Returns ``(clipped sum, per-example norms, losses,
aux)``, as `_materialised.vmap_pass` does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from optclip.per_example.ghost import (
    _batch,
    _factors,
    _interpret,
    _norms,
    _pieces,
    _plans,
    _repeats,
    _shared,
    _sums,
    _target,
    _trace,
)
from optclip.per_example.ghost._batch import Flat, Settings


def trace(one, flat: Flat):
    """The closed jaxpr of one example's loss, its output shapes and its `_trace.Plan`."""
    shared = [  # (the arguments the same for every example: neither batched nor differentiated)
        None if b or p else x
        for x, b, p in zip(flat.leaves, flat.batched, flat.params, strict=True)
    ]
    return _trace.trace(_batch.flat_loss(one, flat), _batch.one_example(flat), flat.params, shared)


def tapped_pass(one, flat: Flat, s: Settings):
    """One forward pass and one backward pass, to the taps at the ghost leaves' sites and to a
    per-example copy of every materialised leaf (no weight gradient is formed). Returns the
    leaves' plans and the `_interpret.Tapped`."""
    closed, out_shape, plan = trace(one, flat)
    where = [i for i, p in enumerate(flat.params) if p]  # each parameter leaf in flat.leaves
    leaves = [flat.leaves[i] for i in where]
    plans = _plans.plan_leaves(list(plan.all_sites()), len(leaves))
    sites = _plans.ghost_sites(plans)
    own = {where[k] for k in _plans.materialised(plans)}  # (each example's copy, `deltas`)
    batched_in = [b or i in own for i, b in enumerate(flat.batched)]
    batched = _trace.batched_sites(plan, closed.jaxpr, batched_in)
    first = next(x for x, b in zip(flat.leaves, flat.batched, strict=True) if b)
    placed = _shared.place(closed.jaxpr, plan, sites, batched)
    taps: dict = {
        i: tuple(
            tuple(_batch.batch_zeros(part, first, sites[i].depth) for part in pair)
            for pair in shapes
        )
        for i, shapes in _interpret.tap_shapes(sites, placed.shapes).items()
    }
    deltas = {k: _batch.batch_zeros(leaves[k], first) for k in _plans.materialised(plans)}

    def single(flat_leaves, taps, deltas):
        flat_leaves = list(flat_leaves)
        for k, delta in deltas.items():  # each example's own copy of a materialised leaf
            flat_leaves[where[k]] = flat_leaves[where[k]] + delta
        records: dict = {}
        outs = _interpret.run(closed.jaxpr, closed.consts, flat_leaves, plan, taps, records, placed)
        return outs, records

    in_axes = [0 if b else None for b in flat.batched]
    tap_axes = {i: ((sites[i].depth,) * 2,) * len(t) for i, t in taps.items()}
    record_axes = {key: site.depth for site in sites.values() for key in site.records}
    mapped = jax.vmap(
        single,
        in_axes=(in_axes, tap_axes, 0),
        out_axes=(0, record_axes),
        spmd_axis_name=s.spmd_axis_name,
    )

    def total(taps, deltas):
        outs, records = mapped(flat.leaves, taps, deltas)
        return jnp.sum(outs[0]), (outs, records)

    passes = jax.grad(total, (0, 1), has_aux=True)
    if any(site.depth for site in sites.values()):  # (a site in a scan: records it stacks)
        passes = _repeats.merged(passes)
    (grads, example_grads), (outs, records) = passes(taps, deltas)

    grads = _pieces.scaled_gradients(sites, placed, grads)
    # (a level is sliced for a record where it is for one of the sites that read it)
    readers: dict = {}
    for site in sites.values():
        for key in site.records:
            readers.setdefault(key, []).append(_factors.sliced_levels(site))
    sliced_of = {k: tuple(map(any, zip(*ls, strict=True))) for k, ls in readers.items()}
    records = {k: _pieces.scale(r, record_axes[k], sliced_of[k]) for k, r in records.items()}
    losses, aux = jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    grad_axes = {i: site.depth for i, site in sites.items()}
    tapped = _interpret.Tapped(
        losses,
        aux,
        records,
        grads,
        example_grads,
        leaves,
        record_axes,
        grad_axes,
        _trace.input_records(plan, closed.jaxpr, sites),
    )
    return plans, dataclasses.replace(tapped, products=_norms.products(plans, tapped))


def finish(target, plans, t: _interpret.Tapped, padding, s: Settings):
    """The norms (`_norms.norms`) and the clipped sums (`_sums.clipped`) from the tapped pass
    `t`, for `target`'s platform."""
    norms = _norms.norms(plans, t, target)
    w, keep, _ = _batch.weights(norms, padding, s)
    sums = _sums.clipped(plans, t, w, keep, target, s.spmd_axis_name)
    return norms, _sums.finished(plans, t, sums, w, keep)


def ghost_pass(one, args, kwargs, padding, s: Settings):
    """Ghost norms, then the clipped sum by book-keeping (`_sums`): from the same records and
    output gradients, with no second pass."""
    flat = _batch.flatten(args, kwargs, s)
    plans, t = tapped_pass(one, flat, s)
    norms, sums = _target.per_platform(lambda target: finish(target, plans, t, padding, s))
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
