"""Where the parameters are used: a static walk of the per-example loss's jaxpr.

A *view* of a parameter leaf is the leaf after linear, shape-only operations, scalings by a
number written in the loss or computed from such numbers, and identities (`_views.View`).
Every other equation with a view among its operands that passes the loss's gradient back to
them (`_jaxprs.flows`: not a ``stop_gradient``, a comparison, or a value only ``has_aux``'s
outputs read) is a *site* (`_sites.Site`), classified by its primitive's rule
(`_rules.classify`). Calls (nested `jit`, `closed_call`), rematerialised blocks
(`checkpoint`) and scans are walked into; their sites are found inside them
(`Plan.subplans`). A `scan` that carries a parameter view or returns one is a fallback site
as a whole (a view leaving it without a site would lose its gradient).
"""

from __future__ import annotations

import collections
import itertools
from typing import NamedTuple

import jax
from jax.extend import core as jcore

from optclip.per_example.ghost import _jaxprs, _rules, _sites, _views


class Plan(NamedTuple):
    """The sites of one jaxpr (by equation index) and the plans of the calls walked into."""

    sites: dict
    subplans: dict

    def all_sites(self):
        yield from self.sites.values()
        for sub in self.subplans.values():
            yield from sub.all_sites()


class _Walk(NamedTuple):
    """What a walk of nested jaxprs shares: the counter of site and record ids, and the
    lengths of the scans it is inside (outermost first)."""

    ids: itertools.count
    stack: tuple


def analyse(jaxpr, views: dict, live_out, known=None, walk=None):
    """The `Plan` of `jaxpr` given the views among its input variables and the indices of its
    outputs the loss's gradient starts from (`live_out`), and the views among those outputs
    (``{output index: View}``). A use is a view among the operands the gradient is passed back
    to (`_jaxprs.flows`); an equation with none is neither a view nor a site. `known`: the
    values of the scalars among its variables known while tracing (its consts, numbers passed
    in: `_views.held`), and those it computes from them go in (`_views.fold`)."""
    walk = _Walk(itertools.count(), ()) if walk is None else walk
    views = dict(views)
    known = dict(known or {})
    sites: dict = {}
    subplans: dict = {}
    keys: dict = {}  # this jaxpr's recorded variables: one record each, whatever its sites
    reach = _jaxprs.flows(jaxpr, live_out)
    for index, eqn in enumerate(jaxpr.eqns):
        if _views.fold(eqn, known):
            continue
        flow = reach.get(index)
        if flow is None:
            continue
        used = tuple(
            (pos, views[v])
            for pos, v in enumerate(eqn.invars)
            if pos in flow.operands and v in views
        )
        if not used:
            continue
        name = eqn.primitive.name
        if name in _views.IDENTITIES:
            views.update((eqn.outvars[pos], view) for pos, view in used)
            continue
        parts = _views.parts(eqn, used, known)
        if parts is not None:
            views.update((v, used[0][1].part(p)) for v, p in zip(eqn.outvars, parts))
            continue
        single = len(eqn.invars) == 1 and _jaxprs.is_float(eqn.outvars[0])
        if name in _views.VIEW_PRIMITIVES and single:
            views[eqn.outvars[0]] = used[0][1].then(eqn)
            continue
        number = _views.scaling(eqn, used, known)
        if number is not False:
            views[eqn.outvars[0]] = used[0][1].times(eqn, number)
            continue
        if name == "scan":
            subplan = _scan(eqn, used, flow.outputs, known, walk)
            if subplan is not None:
                subplans[index] = subplan
                continue
            why = _sites.fallback(eqn, "carries a parameter or returns a view of one")
            sites[index] = _site(eqn, used, why, (), walk)
            continue
        inner = _jaxprs.sub_jaxpr(eqn)
        if inner is not None:
            sub_views = {inner[0].invars[pos]: view for pos, view in used}
            sub_known = _views.held(inner[0].constvars, inner[1]) | _passed(
                eqn.invars, inner[0].invars, known
            )
            subplan, out_views = analyse(inner[0], sub_views, flow.outputs, sub_known, walk)
            if subplan.sites or subplan.subplans:
                subplans[index] = subplan
            for i, view in out_views.items():
                views[eqn.outvars[i]] = view
            continue
        classified = _rules.classify(eqn, used)
        records = tuple(
            keys.setdefault(v, next(walk.ids)) if isinstance(v, jcore.Var) else next(walk.ids)
            for v in (eqn.invars[i] for i in _sites.recorded(classified.kind, eqn, used))
        )
        sites[index] = _site(eqn, used, classified, records, walk)
    out_views = {
        i: views[v]
        for i, v in enumerate(jaxpr.outvars)
        if i in live_out and isinstance(v, jcore.Var) and v in views
    }
    return Plan(sites, subplans), out_views


def _site(eqn, used, classified: _sites.Classified, records, walk: _Walk) -> _sites.Site:
    kind, reason, layout = classified
    return _sites.Site(next(walk.ids), eqn, used, kind, reason, layout, walk.stack, records)


def batched_sites(plan: Plan, jaxpr, batched_in) -> frozenset:
    """The ids of the sites some operand of which differs between examples (`_jaxprs.batched`,
    given which inputs of `jaxpr` do, `batched_in`). A site none of whose operands does (a
    lookup of positions ``table[jnp.arange(T)]``, a dense layer applied to a constant) has,
    under `jax.vmap`, one output shared by the batch, whose gradient is the sum of every
    example's: `_interpret.run` makes that output differ between examples (its tap added), so
    that each example's output gradient is its own."""
    varying, bodies = _jaxprs.batched(jaxpr, batched_in)
    out = {
        site.id
        for site in plan.sites.values()
        if any(isinstance(v, jcore.Var) and v in varying for v in site.eqn.invars)
    }
    for index, subplan in plan.subplans.items():
        body = _jaxprs.inner_jaxpr(jaxpr.eqns[index])
        out |= batched_sites(subplan, body, bodies.get(index, [False] * len(body.invars)))
    return frozenset(out)


def input_records(plan: Plan, jaxpr, sites: dict) -> frozenset:
    """The record keys of `sites` (``{id: site}``, the tapped ones) that are inputs of the loss
    `jaxpr` or their elements reshaped (`_views.RESHAPES`), recorded by one site of `plan`
    outside every call and scan and read by no other: the caller holds them (`_sums` puts the
    examples' factors on them)."""
    readers = collections.Counter(key for site in sites.values() for key in site.records)
    made = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

    def source(v):
        eqn = made.get(v) if isinstance(v, jcore.Var) else None
        if eqn is None or eqn.primitive.name not in _views.RESHAPES:
            return v
        return source(eqn.invars[0]) if eqn.invars[0].aval.size == v.aval.size else v

    inputs = set(jaxpr.invars)
    return frozenset(
        key
        for site in plan.sites.values()
        if site.id in sites
        for key, i in zip(site.records, site.recorded, strict=True)
        if readers[key] == 1 and source(site.eqn.invars[i]) in inputs
    )


def _passed(operands, invars, known) -> dict:
    """The values of the body's inputs `invars` that are `known` numbers (`operands`: the
    equation's, in the same order)."""
    values = [_views.constant(v, known) for v in operands]
    return _views.held(invars, values)


def _scan(eqn, used, live_out, known, walk: _Walk):
    """The plan of a `scan`'s body (its sites stacked along the scan), or None when a
    parameter view is carried or returned (its gradient would not pass through a site);
    `live_out`: the body's outputs the gradient reaches; `known`: numbers among its operands
    (those among its consts are known in the body: the same at every step)."""
    closed = eqn.params["jaxpr"]
    body = closed.jaxpr
    consts, carry = _jaxprs.scan_counts(eqn)
    length = eqn.params["length"]
    if any(consts <= pos < consts + carry for pos, _ in used):
        return None
    inner = {body.invars[pos]: view.enter_scan(pos >= consts, length) for pos, view in used}
    sub_known = _views.held(body.constvars, closed.consts) | _passed(
        eqn.invars[:consts], body.invars[:consts], known
    )
    deeper = _Walk(walk.ids, (*walk.stack, length))
    subplan, out_views = analyse(body, inner, live_out, sub_known, deeper)
    return None if out_views else subplan


def trace(fun, args, param_mask, values=None):
    """The closed jaxpr of ``fun(*args)``, its output tree, and the `Plan` of its uses of the
    leaves of `args` where `param_mask` (a list over the flattened `args`) is True. `values`:
    per flattened arg, its value where it is the same for every example (an argument neither
    differentiated nor batched: a number the scalings may use, `_views.held`), else None."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    views = {}
    leaf = 0
    for var, is_param in zip(jaxpr.invars, param_mask, strict=True):
        if is_param:
            views[var] = _views.View(leaf, tuple(var.aval.shape))
            leaf += 1
    known = _views.held(jaxpr.constvars, closed.consts)
    if values is not None:
        known |= _views.held(jaxpr.invars, values)
    plan, _ = analyse(jaxpr, views, {0}, known=known)  # (the loss; `has_aux`'s outputs follow)
    return closed, out_shape, plan
