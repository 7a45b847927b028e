"""Where the parameters are used: a static walk of the per-example loss's jaxpr.

A *view* of a parameter leaf is the leaf after linear, shape-only operations, scalings by a
number written in the loss or computed from such numbers, and identities (`_views.View`).
Every other equation with a view among its operands that passes the loss's gradient back to
them (`_jaxprs.flows`: not a ``stop_gradient``, a comparison, or a value only ``has_aux``'s
outputs read) is a *site*: its output gets a tap, its other operands are recorded, and its
per-example gradient (or only that gradient's norm) is computed from them. A site is

* ``"dense"``: `dot_general` with one view operand reached through dtype conversions and
  transposes (dense layers, einsums with sequence and head dimensions);
* ``"embed"``: `gather` of rows of a 2-D view (an embedding lookup);
* ``"fallback"``: anything else (its per-example gradient is materialised, for that use only).

Calls (nested `jit`, `closed_call`) and rematerialised blocks (`checkpoint`) are walked into;
their sites are found inside them (`Plan.subplans`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import jax
from jax.extend import core as jcore

from optclip.ghost import _jaxprs, _views

ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul", "neg", "div"})


@dataclasses.dataclass
class Site:
    """An equation that uses parameter views: `views` are ``(operand position, View)``.

    `layout` (dense and embed sites) is ``(h, x, y, pins)``: the leaf dimensions of the
    per-example gradient's shared (head) dimensions, of the factor built from the recorded
    operand and of the factor built from the output gradient, as ``sum_k x_k (outer) y_k`` per
    head, and the single indices the use takes of the other leaf dimensions."""

    id: int
    eqn: Any
    views: tuple
    kind: str
    reason: str
    layout: tuple | None = None
    stack: tuple = ()  # the lengths of the scans it is inside, outermost first
    records: tuple = ()  # the keys of its recorded operands (shared by sites that record one)
    batched: bool = True  # whether its operands differ between examples (`mark_batched`)


@dataclasses.dataclass
class Plan:
    """The sites of one jaxpr (by equation index) and the plans of the calls walked into."""

    sites: dict = dataclasses.field(default_factory=dict)
    subplans: dict = dataclasses.field(default_factory=dict)

    def all_sites(self):
        yield from self.sites.values()
        for sub in self.subplans.values():
            yield from sub.all_sites()


def analyse(jaxpr, views: dict, live_out, ids=None, known=None):
    """The `Plan` of `jaxpr` given the views among its input variables and the indices of its
    outputs the loss's gradient starts from (`live_out`), and the views among those outputs
    (``{output index: View}``). A use is a view among the operands the gradient is passed back
    to (`_jaxprs.flows`: not through a ``stop_gradient``, a comparison, an array with no
    entries, a scan of no steps...); an equation with none is neither a view nor a site.
    `known`: the values of the scalars among its variables known while tracing (its consts,
    numbers passed in: `_views.held`), and those it computes from them go in (`_views.fold`)."""
    ids = itertools.count() if ids is None else ids
    views = dict(views)
    known = dict(known or {})
    plan = Plan()
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
        single = len(eqn.invars) == 1 and _jaxprs.is_float(eqn.outvars[0])
        if name in _views.VIEW_PRIMITIVES and single:
            views[eqn.outvars[0]] = used[0][1].then(eqn)
            continue
        number = _views.scaling(eqn, used, known)
        if number is not False:
            views[eqn.outvars[0]] = used[0][1].times(eqn, number)
            continue
        if name == "scan":
            subplan = _scan(eqn, used, flow.outputs, ids, known)
            if subplan is not None:
                plan.subplans[index] = subplan
                continue
            plan.sites[index] = _fallback(
                next(ids), eqn, used, "carries a parameter or returns a view of one"
            )
            continue
        inner = _jaxprs.sub_jaxpr(eqn)
        if inner is not None:
            sub_views = {inner[0].invars[pos]: view for pos, view in used}
            sub_known = _views.held(inner[0].constvars, inner[1]) | _passed(
                eqn.invars, inner[0].invars, known
            )
            subplan, out_views = analyse(inner[0], sub_views, flow.outputs, ids, sub_known)
            if subplan.sites or subplan.subplans:
                plan.subplans[index] = subplan
            for i, view in out_views.items():
                views[eqn.outvars[i]] = view
            continue
        site = plan.sites[index] = _site(next(ids), eqn, used)
        site.records = tuple(
            keys.setdefault(v, next(ids)) if isinstance(v, jcore.Var) else next(ids)
            for i, v in enumerate(eqn.invars)
            if i not in {pos for pos, _ in used}
        )
    out_views = {
        i: views[v]
        for i, v in enumerate(jaxpr.outvars)
        if i in live_out and isinstance(v, jcore.Var) and v in views
    }
    return plan, out_views


def mark_batched(plan: Plan, jaxpr, batched_in) -> None:
    """Sets each site's `batched`: False where none of its operands differs between examples
    (`_jaxprs.batched`, given which inputs of `jaxpr` do, `batched_in`): a lookup of positions
    ``table[jnp.arange(T)]``, a dense layer applied to a constant. Under `jax.vmap` its output
    is then one value shared by the batch, whose gradient is the sum of every example's:
    `_interpret.run` makes that output differ between examples (its tap added), so that each
    example's output gradient is its own."""
    varying, bodies = _jaxprs.batched(jaxpr, batched_in)
    for site in plan.sites.values():
        site.batched = any(isinstance(v, jcore.Var) and v in varying for v in site.eqn.invars)
    for index, subplan in plan.subplans.items():
        eqn = jaxpr.eqns[index]
        body = _jaxprs.inner_jaxpr(eqn)
        mark_batched(subplan, body, bodies.get(index, [False] * len(body.invars)))


def _passed(operands, invars, known) -> dict:
    """The values of the body's inputs `invars` that are `known` numbers (`operands`: the
    equation's, in the same order)."""
    values = [_views.constant(v, known) for v in operands]
    return _views.held(invars, values)


def _scan(eqn, used, live_out, ids, known):
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
    subplan, out_views = analyse(body, inner, live_out, ids, sub_known)
    if out_views:
        return None
    for site in subplan.all_sites():
        site.stack = (length, *site.stack)
    return subplan


def _site(site_id: int, eqn, used) -> Site:
    name = eqn.primitive.name
    if name == "dot_general":
        return _dense(site_id, eqn, used)
    if name == "gather":
        return _embed(site_id, eqn, used)
    if name == "conv_general_dilated":
        return _conv(site_id, eqn, used)
    if name in ELEMENTWISE:
        why = (
            f"elementwise `{name}` (a bias or a scale): per-example gradient of the "
            "parameter's size"
        )
        return Site(site_id, eqn, used, "fallback", why)
    return Site(site_id, eqn, used, "fallback", f"no closed form for `{name}`")


def _fallback(site_id, eqn, used, why: str) -> Site:
    return Site(site_id, eqn, used, "fallback", f"`{eqn.primitive.name}` {why}")


def _dense(site_id: int, eqn, used) -> Site:
    if len(used) != 1:
        return _fallback(site_id, eqn, used, "of two parameter views")
    pos, view = used[0]
    ndim = len(eqn.invars[pos].aval.shape)
    mapped = view.leaf_dims()
    if mapped is None:
        return _fallback(site_id, eqn, used, "of a reshaped, broadcast or sliced parameter")
    dims, levels, pins = mapped
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    contract = tuple(contract_l if pos == 0 else contract_r)
    batch = tuple(batch_l if pos == 0 else batch_r)
    free = tuple(d for d in range(ndim) if d not in contract + batch)
    heads = tuple(d for d in levels if d is not None) + tuple(dims[d] for d in batch)
    layout = (heads, *(tuple(dims[d] for d in group) for group in (contract, free)), pins)
    return Site(site_id, eqn, used, "dense", "dense (`dot_general`): ghost norm", layout)


def _conv(site_id: int, eqn, used) -> Site:
    """A convolution by a kernel view (a plain view: dtype conversions, transposes, a scan's
    slices, single indices): ghost from the input's patches. Its layout names the leaf's
    dimensions of the kernel's input features and window (the patches' features, in their
    order) and of its output features, and the feature groups (the heads: each group's
    patches times its outputs), so that two convolutions by one kernel laid out alike have
    their cross terms."""
    pos, view = used[0]
    if len(used) != 1 or pos != 1:
        return _fallback(site_id, eqn, used, "of a parameter as its input (not its kernel)")
    if eqn.params["batch_group_count"] != 1:
        return _fallback(site_id, eqn, used, "with `batch_group_count` (no closed form written)")
    mapped = view.leaf_dims()
    if mapped is None:
        return _fallback(site_id, eqn, used, "by a reshaped, broadcast or sliced kernel")
    dims, levels, pins = mapped
    rhs = eqn.params["dimension_numbers"].rhs_spec
    heads = (*(d for d in levels if d is not None), ("groups", eqn.params["feature_group_count"]))
    layout = (heads, tuple(dims[d] for d in rhs[1:]), (dims[rhs[0]],), pins)
    return Site(site_id, eqn, used, "conv", "convolution: ghost norm from patches", layout)


class Lookup(NamedTuple):
    """An embedding lookup: the table's `row` dimension, the positions in each index vector
    of the row's index and (where the index vector also names the other dimension, always
    starting at 0 since its slice is whole, as ``jax.vmap(lambda i: table[i])`` writes it) of
    the column's, else None, and the output's dimension of the row's `features`."""

    row: int
    row_index: int
    column_index: int | None
    features: int


def lookup(eqn, pos: int) -> Lookup | None:
    """How a `gather` of operand `pos` looks up whole rows of a 2-D table, one index per row
    (``table[ids]``, ``jnp.take(table, ids, axis=...)``, ``jax.vmap(lambda i: table[i])``,
    columns: ``table[:, ids]``), the row's features at any place in the output; else None."""
    numbers = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    indices = eqn.invars[1].aval.shape
    starts = tuple(numbers.start_index_map)
    if pos != 0 or len(shape) != 2 or numbers.operand_batching_dims or not indices:
        return None
    collapsed = tuple(numbers.collapsed_slice_dims)
    offsets = tuple(numbers.offset_dims)  # (the output's dimensions of the operand's kept ones)
    if len(collapsed) == 1:
        row = collapsed[0]
    elif not collapsed and tuple(eqn.params["slice_sizes"])[0] == 1:
        row = 0  # the row's slice dimension kept (size 1): the first of the offsets
    else:
        return None
    full = tuple(1 if d == row else shape[d] for d in range(2))
    if (
        tuple(eqn.params["slice_sizes"]) != full
        or row not in starts
        or not set(starts) <= {0, 1}
        or indices[-1] != len(starts)
        or len(offsets) != 2 - len(collapsed)
    ):
        return None
    column = starts.index(1 - row) if 1 - row in starts else None
    return Lookup(row, starts.index(row), column, offsets[-1])


def _embed(site_id: int, eqn, used) -> Site:
    pos, view = used[0]
    found = lookup(eqn, pos) if len(used) == 1 and not view.depth else None
    mapped = view.leaf_dims() if found is not None else None
    if found is None or mapped is None or len(mapped[0]) != 2:
        return _fallback(
            site_id, eqn, used, "is not a lookup of whole rows of a parameter outside a scan"
        )
    dims, _, pins = mapped
    layout = ((), (dims[found.row],), (dims[1 - found.row],), pins)
    return Site(site_id, eqn, used, "embed", "embedding lookup (`gather`): ghost norm", layout)


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
