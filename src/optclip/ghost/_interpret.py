"""The per-example loss evaluated equation by equation, with taps at the sites.

At every site (`_trace.Site`) the equation's floating-point outputs get a tap added (zero in
value: its gradient is the output gradient of that example at that site) and the operands that
are not parameter views are recorded (the activations, the indices of a lookup). Calls with
sites inside are evaluated inline; rematerialised blocks stay rematerialised
(`jax.checkpoint` of the same evaluation, with their taps in and their records out).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from optclip.ghost import _trace


def bind(eqn, invals):
    """The outputs of `eqn` on `invals`, always as a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: tuple = ()
    if isinstance(params, tuple):  # (older JAX: subfunctions first)
        subfuns, params = params
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with contextlib.nullcontext() if ctx is None else ctx:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def float_outputs(eqn):
    """The indices of `eqn`'s floating-point outputs (the ones tapped)."""
    return [
        j
        for j, v in enumerate(eqn.outvars)
        if hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.inexact)
    ]


def zero_taps(plan):
    """One example's taps: ``{site id: tuple of zeros, one per floating output}``."""
    taps = {}
    for site in plan.all_sites():
        taps[site.id] = tuple(
            jnp.zeros(
                (*site.stack, *site.eqn.outvars[j].aval.shape), site.eqn.outvars[j].aval.dtype
            )
            for j in float_outputs(site.eqn)
        )
    return taps


def site_records(site, records):
    """`site`'s recorded operands, from the records of the tapped pass."""
    return [records[key] for key in site.records]


def recorded_positions(site):
    """The operand positions of `site` that are recorded (every one but the views)."""
    views = {pos for pos, _ in site.views}
    return [i for i in range(len(site.eqn.invars)) if i not in views]


def run(jaxpr, consts, args, plan, taps, records):
    """Evaluates `jaxpr` on `args` with the taps of `plan`'s sites, filling `records`
    (``{record key: recorded operand}``, see `site_records`). Returns the outputs."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for index, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        if index in plan.subplans:
            outs = _call(eqn, plan.subplans[index], invals, taps, records)
        else:
            outs = bind(eqn, invals)
            site = plan.sites.get(index)
            if site is not None:
                for key, i in zip(site.records, recorded_positions(site), strict=True):
                    records[key] = invals[i]
                for tap, j in zip(taps[site.id], float_outputs(eqn), strict=True):
                    outs[j] = outs[j] + tap
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _scan(eqn, subplan, invals, taps, records):
    """A `scan` with sites in its body: the body evaluated by `run`, the taps of its sites
    sliced along the scan like its ``xs`` and the records stacked like its ``ys``."""
    params = eqn.params
    body = params["jaxpr"]
    consts, carry = params["num_consts"], params["num_carry"]
    ids = [site.id for site in subplan.all_sites()]

    def step(state, x):
        xs, step_taps = x
        step_records: dict = {}
        args = [*invals[:consts], *state, *xs]
        outs = run(body.jaxpr, body.consts, args, subplan, step_taps, step_records)
        return outs[:carry], (outs[carry:], step_records)

    state, (ys, scan_records) = lax.scan(
        step,
        invals[consts : consts + carry],
        (invals[consts + carry :], {i: taps[i] for i in ids}),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    records.update(scan_records)
    return [*state, *ys]


def _call(eqn, subplan, invals, taps, records):
    """A call, rematerialised block or scan with sites inside, evaluated by `run`."""
    if eqn.primitive.name == "scan":
        return _scan(eqn, subplan, invals, taps, records)
    jaxpr, consts = _trace.sub_jaxpr(eqn)
    if eqn.primitive.name not in _trace.REMATS:
        return run(jaxpr, consts, invals, subplan, taps, records)
    ids = [site.id for site in subplan.all_sites()]

    def block(invals, block_taps):
        block_records: dict = {}
        outs = run(jaxpr, consts, invals, subplan, block_taps, block_records)
        return outs, block_records

    remat = jax.checkpoint(
        block,
        prevent_cse=eqn.params.get("prevent_cse", True),
        policy=eqn.params.get("policy"),
    )
    outs, block_records = remat(invals, {i: taps[i] for i in ids})
    records.update(block_records)
    return outs
