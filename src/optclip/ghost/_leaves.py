"""Each parameter leaf's per-example gradient norm: ghost where every use has a closed form, else
from its per-example gradient, materialised for that leaf only.

A leaf goes *ghost* when every use is a dense or embedding site and all of them share one
layout (or its transpose: the input and output embeddings of a tied model); its squared norm is
then the sum over every pair of uses (`_factors.leaf_terms`, the cross terms included). Any other
leaf is *materialised*: each use's per-example gradient is that equation's VJP for that example
(`jax.vmap` of `jax.vjp` of the one equation, with the example's recorded operands and output
gradient), pulled back through the view's chain and summed over uses; its squared norm is summed in
float32 after a power-of-two rescaling per example (`_factors.sum_of_squares`: exact at every
magnitude, where `_per_example.example_norms` trusts a sum whose squares all flushed).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from optclip import _norm_rules
from optclip.ghost import _factors, _interpret, _trace


@dataclasses.dataclass
class LeafPlan:
    """How one leaf's norm is computed: `mode` is ``"ghost"``, ``"materialised"`` or
    ``"unused"``; `uses` are ``(site, operand position, View)``; `swapped` says, per use, that
    its factors are exchanged to match the first use's layout; `reason` says why."""

    mode: str
    uses: list
    swapped: list
    reason: str
    groups: list = dataclasses.field(default_factory=list)  # uses whose cross terms count


def plan_leaves(sites, count: int):
    """The `LeafPlan` of each of the `count` parameter leaves."""
    uses: list = [[] for _ in range(count)]
    for site in sites:
        for pos, view in site.views:
            uses[view.leaf].append((site, pos, view))
    return [_leaf_plan(u) for u in uses]


def _leaf_plan(uses) -> LeafPlan:
    if not uses:
        return LeafPlan("unused", [], [], "not used by the loss (zero gradient)")
    others = [site for site, _, _ in uses if site.kind == "fallback"]
    if not others and len(uses) > 1 and any(site.kind == "conv" for site, _, _ in uses):
        why = "a convolution kernel used more than once (no closed cross term written)"
        return LeafPlan("materialised", uses, [], why)
    if others:
        return LeafPlan("materialised", uses, [], others[0].reason)
    groups: dict = {}  # the uses of each set of single indices taken (`slice`s)
    for i, (site, _, _) in enumerate(uses):
        groups.setdefault(site.layout[3], []).append(i)
    for a, b in itertools.combinations(groups, 2):
        pins = dict(b)
        if not any(d in pins and pins[d] != i for d, i in a):
            why = "used through overlapping slices (no closed cross term)"
            return LeafPlan("materialised", uses, [], why)
    swapped = [False] * len(uses)
    for members in groups.values():
        first = uses[members[0]][0].layout
        for i in members:
            layout = uses[i][0].layout
            if layout[:3] == (first[0], first[2], first[1]) and layout[:3] != first[:3]:
                swapped[i] = True
            elif layout[:3] != first[:3]:
                why = "used by closed-form operations in different layouts (no closed cross term)"
                return LeafPlan("materialised", uses, [], why)
    kinds = sorted({site.kind for site, _, _ in uses})
    why = f"ghost: {len(uses)} use(s), " + ", ".join(kinds)
    if any(len(m) > 1 for m in groups.values()):
        why += " with cross terms"
    return LeafPlan("ghost", uses, swapped, why, list(groups.values()))


def _factors_of(site, pos, records, grads, acc):
    """A dense or embed use's factors ``(x, y, exponent)``."""
    record = _interpret.site_records(site, records)[0]
    grad = grads[site.id][0]
    if site.kind == "dense":
        _, levels, _ = site.views[0][1].leaf_dims()
        sliced = tuple(level is not None for level in levels)
        return _factors.dense_factors(record, grad, site.eqn, pos, acc, sliced)
    if site.kind == "conv":
        return _factors.conv_factors(record, grad, site.eqn, acc)
    row = _trace.embed_rows(site.eqn, pos)
    assert row is not None  # (an embed site is a lookup of rows)
    return _factors.embed_factors(record, grad, site.eqn, row, acc)


def ghost_terms(leaf_plan, records, grads, acc):
    """``(exponent, value)`` of a ghost leaf's squared per-example norms."""
    uses = []
    for (site, pos, _), swap in zip(leaf_plan.uses, leaf_plan.swapped, strict=True):
        x, y, e = _factors_of(site, pos, records, grads, acc)
        uses.append((y, x, e) if swap else (x, y, e))
    # Uses of different single indices of a dimension are orthogonal: no cross term.
    terms = [_factors.leaf_terms([uses[i] for i in group], acc) for group in leaf_plan.groups]
    return _factors.add_terms(terms)


def equation(site):
    """``f(record, *views)``: `site`'s equation on one example's recorded operands and the
    views, at every iteration of the scans it is inside (all stacked along leading axes),
    returning its floating-point outputs."""
    positions = [pos for pos, _ in site.views]
    recorded = _interpret.recorded_positions(site)
    outputs = _interpret.float_outputs(site.eqn)

    def f(record, *views):
        invals = [None] * len(site.eqn.invars)
        for i, x in zip(recorded, record, strict=True):
            invals[i] = x
        for i, x in zip(positions, views, strict=True):
            invals[i] = x
        outs = _interpret.bind(site.eqn, invals)
        return [outs[j] for j in outputs]

    for _ in site.stack:
        f = jax.vmap(f)
    return f


def pull_back(site, leaves, cotangents):
    """The views' cotangents of `site` carried back to their leaves (summed per leaf)."""
    out: dict = {}
    for (_, view), ct in zip(site.views, cotangents, strict=True):
        (g,) = jax.linear_transpose(view.stacked, leaves[view.leaf])(ct)
        out[view.leaf] = g if view.leaf not in out else out[view.leaf] + g
    return out


def site_gradients(site, leaves, records, grads, spmd_axis_name=None):
    """Every example's gradient of each parameter leaf `site` uses, from that one equation
    (at every iteration of the scans it is inside): ``{leaf index: (B, *leaf.shape)}``."""
    values = [view.stacked(leaves[view.leaf]) for _, view in site.views]
    f = equation(site)

    def one(record, grad):
        _, pull = jax.vjp(lambda *views: f(record, *views), *values)
        return pull_back(site, leaves, pull(list(grad)))

    record = _interpret.site_records(site, records)
    return jax.vmap(one, spmd_axis_name=spmd_axis_name)(record, grads[site.id])


def materialised_gradients(leaf_plans, leaves, records, grads, spmd_axis_name=None):
    """The per-example gradients ``{leaf index: (B, *shape)}`` of the materialised leaves."""
    wanted = {i for i, p in enumerate(leaf_plans) if p.mode == "materialised"}
    sites = {}
    for i in sorted(wanted):
        for site, _, _ in leaf_plans[i].uses:
            sites[site.id] = site
    out: dict = {}
    for site in sites.values():
        for leaf, g in site_gradients(site, leaves, records, grads, spmd_axis_name).items():
            if leaf in wanted:
                out[leaf] = g if leaf not in out else out[leaf] + g
    return out


def leaf_norm_terms(leaf_plans, leaves, records, grads, batch: int, spmd_axis_name=None):
    """``(exponent, value)`` of every leaf's squared per-example norms, in leaf order."""
    acc = _norm_rules.widest_accum_dtype([x.dtype for x in leaves] or [jnp.float32])
    materialised = materialised_gradients(leaf_plans, leaves, records, grads, spmd_axis_name)
    terms = []
    for i, plan in enumerate(leaf_plans):
        if plan.mode == "ghost":
            terms.append(ghost_terms(plan, records, grads, acc))
        elif plan.mode == "materialised":
            terms.append(_factors.sum_of_squares(materialised[i], acc))
        else:
            terms.append((jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), acc)))
    return terms
