"""Sites whose output gradients are equal, so that the tapped pass keeps one of them.

An LSTM cell written as Equinox and Flax write it adds its input's and its state's products
before the gates (``W_i x + b + W_h h``): both products' output gradients are the gradient of
the sum. An output used once, by an `add` of two operands of its own shape and dtype, has the
output gradient of that sum; following such adds from two sites' outputs to the same variable
proves their output gradients equal. The tapped pass then taps the first site only, records
the others' operands as before, and hands each of them the first's output gradient: one
stack of output gradients per sum, not one per product, in a scan as long as the sequence.
"""

from __future__ import annotations

import collections

from jax.extend import core as jcore

from optclip.per_example.ghost import _interpret, _jaxprs

SUMS = frozenset({"add", "add_any"})


def shared(jaxpr, plan, ids) -> dict:
    """``{site id: id of the site whose output gradient it shares}`` among the sites `ids` of
    `plan` (the tapped ones) in `jaxpr` and the jaxprs it calls, each shared id mapped to the
    first site of its sum (by id)."""
    out: dict = {}
    users: collections.Counter = collections.Counter()
    consumer: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                users[v] += 1
                consumer[v] = eqn
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            users[v] += 2  # (its gradient comes from outside: never followed)
    roots: dict = {}
    for site in plan.sites.values():
        outputs = _interpret.float_outputs(site.eqn)
        if site.id in ids and len(site.eqn.outvars) == 1 and outputs == [0]:
            v = site.eqn.outvars[0]
            root = _sum_of(v, users, consumer)
            if root is not v:
                roots.setdefault(root, []).append(site.id)
    for group in roots.values():
        out.update({i: min(group) for i in group if i != min(group)})
    for index, sub in plan.subplans.items():
        eqn = jaxpr.eqns[index]
        inner = eqn.params["jaxpr"].jaxpr if eqn.primitive.name == "scan" else None
        inner = inner if inner is not None else (_jaxprs.sub_jaxpr(eqn) or (None,))[0]
        if inner is not None:
            out.update(shared(inner, sub, ids))
    return out


def _sum_of(v, users, consumer):
    """The variable whose output gradient `v`'s is: `v` followed through every `add` that is
    its only use and adds two operands of its shape and dtype."""
    while users[v] == 1 and consumer[v].primitive.name in SUMS:
        eqn = consumer[v]
        avals = [(x.aval.shape, x.aval.dtype) for x in (*eqn.invars, *eqn.outvars)]
        if len(eqn.invars) != 2 or any(a != (v.aval.shape, v.aval.dtype) for a in avals):
            break
        v = eqn.outvars[0]
    return v
