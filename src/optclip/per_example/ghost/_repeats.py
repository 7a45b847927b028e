"""The tapped pass's program with the stacks its scans write twice written once.

A record of a scanned cell's state (``W_hh h`` reads ``h_{t-1}``, the scan's carry) is an
output stacked by the scan, one slice per step. Where the cell's backward pass reads that state
too (a GRU's update gate mixes ``h_{t-1}`` into its output), JAX's partial evaluation of the
scan stacks the same carry again as a residual of the backward pass: two outputs of the forward
scan are one variable of its body, and XLA keeps both buffers. `merged` traces the pass and
keeps each such output once, every reader of the others reading it.
"""

from __future__ import annotations

import jax
from jax.extend import core as jcore


def merged(f):
    """`f` (arrays in, a pytree of arrays out), traced once with its scans' repeated stacked
    outputs kept once (`without_repeats`) and evaluated in the caller's trace: the same values,
    one buffer fewer per repeat."""

    def g(*args):
        closed, shape = jax.make_jaxpr(f, return_shape=True)(*args)
        jaxpr = without_repeats(closed.jaxpr)
        out = jax.core.eval_jaxpr(jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), out)

    return g


def without_repeats(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """`jaxpr` with each top-level scan's stacked outputs that its body writes from one
    variable kept once; the readers of a dropped one read the kept one."""
    renamed: dict = {}
    read = lambda v: renamed.get(v, v) if isinstance(v, jcore.Var) else v  # noqa: E731
    eqns = []
    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
        if eqn.primitive.name == "scan":
            eqn = _scan_without_repeats(eqn, renamed)
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])


def _scan_without_repeats(eqn, renamed: dict):
    """The scan `eqn` with its repeated stacked outputs dropped, each recorded in `renamed`
    (``{dropped output: kept output}``)."""
    body = eqn.params["jaxpr"]
    carry = eqn.params["num_carry"]
    ys = body.jaxpr.outvars[carry:]
    outs = eqn.outvars[carry:]
    groups: dict = {}  # (body variable -> indices of the outputs it is written to)
    for i, v in enumerate(ys):
        if isinstance(v, jcore.Var):
            groups.setdefault(v, []).append(i)
    dropped = set()
    for indices in groups.values():
        if len(indices) < 2:
            continue
        used = [i for i in indices if not isinstance(outs[i], jcore.DropVar)]
        kept = used[0] if used else indices[0]
        for i in indices:
            if i != kept:
                dropped.add(i)
                if not isinstance(outs[i], jcore.DropVar):
                    renamed[outs[i]] = outs[kept]
    if not dropped:
        return eqn
    keep = [i for i in range(len(ys)) if i not in dropped]
    inner = body.jaxpr
    info = inner.debug_info
    inner = inner.replace(
        outvars=inner.outvars[:carry] + [ys[i] for i in keep],
        debug_info=None if info is None else info.with_unknown_names(),
    )
    return eqn.replace(
        params={**eqn.params, "jaxpr": jcore.ClosedJaxpr(inner, body.consts)},
        outvars=eqn.outvars[:carry] + [outs[i] for i in keep],
    )
