"""Reading the per-example loss's jaxpr: the calls and scans walked into, and which equations
pass the loss's gradient back to their operands (a backward walk from the loss).

A parameter used only where no gradient flows back (``lax.stop_gradient``, a comparison, a
sign, ``argmax``, a conversion to integers, a value that reaches only the auxiliary outputs of
``has_aux``) has a zero gradient through that use: `_trace` makes no site of it. Each such use
was a fallback site, and its leaf's per-example gradient was materialised (zeros; a frozen
embedding's, ``stop_gradient(table)``, a table per example). No gradient flows back through an
array with no entries either, nor from a product (`dot_general`, a convolution) with an operand
of no entries (it is zero whatever the other), nor into the body of a `scan` of no steps (its
carries are passed through).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
REMATS = frozenset({"remat2", "checkpoint", "remat"})
# Primitives with a floating-point output whose derivative is zero wherever it is defined.
NO_GRADIENT = frozenset({"stop_gradient", "sign", "floor", "ceil", "round"})
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})  # zero if an operand is empty


def sub_jaxpr(eqn):
    """The ``(jaxpr, consts)`` of a call or rematerialised block walked into, else None."""
    name = eqn.primitive.name
    if name in CALLS and CALLS[name] in eqn.params:
        inner = eqn.params[CALLS[name]]
    elif name in REMATS and "jaxpr" in eqn.params:
        inner = eqn.params["jaxpr"]
    else:
        return None
    if isinstance(inner, jcore.ClosedJaxpr):
        return inner.jaxpr, inner.consts
    return inner, ()


def call_products(eqn) -> list:
    """The outputs of the products (`PRODUCTS`) inside the call `eqn` (`CALLS`) and the calls
    it makes; none for any other equation."""
    if eqn.primitive.name not in CALLS or sub_jaxpr(eqn) is None:
        return []
    inner = sub_jaxpr(eqn)[0].eqns
    own = [v for e in inner if e.primitive.name in PRODUCTS for v in e.outvars]
    return own + [v for e in inner for v in call_products(e)]


def scan_counts(eqn) -> tuple[int, int]:
    """A `scan`'s numbers of consts and of carries, which lead its operands and its body's
    inputs: its ``num_consts`` and ``num_carry`` (jax 0.10), or the sizes of the first two of
    the three parts of its ``ft_in`` (jax 0.11: consts, carries, scanned inputs)."""
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    try:
        parts = params["ft_in"].unpack()
        if len(parts) == 3:
            return len(parts[0]), len(parts[1])
    except Exception:  # noqa: BLE001 - none, or not three parts: refused below, by name
        pass
    raise NotImplementedError(
        f"clipped_grad does not know the parameters of this JAX's ({jax.__version__}) `scan` "
        f"({', '.join(sorted(params))}): where its consts and carries are is not known"
    )


def is_float(var) -> bool:
    dtype = getattr(var.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


class Flow(NamedTuple):
    """Where the gradient passes through one equation: the indices of its `outputs` it
    reaches, and the positions of the `operands` it is passed back to."""

    outputs: set
    operands: frozenset


def flows(jaxpr, live_out) -> dict:
    """``{equation index: Flow}`` for the equations of `jaxpr` that pass the gradient back to
    their operands, given the indices of its outputs the gradient starts from (`live_out`: the
    loss's, for the traced loss)."""
    return _walk(jaxpr, live_out)[0]


def _walk(jaxpr, live_out):
    """`flows`, and the input variables of `jaxpr` the gradient reaches."""
    live = {v for i, v in enumerate(jaxpr.outvars) if i in live_out and _floating(v)}
    out: dict = {}
    for index in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[index]
        reached = {i for i, v in enumerate(eqn.outvars) if v in live}
        name = eqn.primitive.name
        zero = name in NO_GRADIENT or (name in PRODUCTS and any(map(_empty, eqn.invars)))
        if not reached or zero:
            continue
        outputs, positions = _operands(eqn, reached)
        at = frozenset(p for p in positions if _floating(eqn.invars[p]))
        out[index] = Flow(outputs, at)
        live |= {eqn.invars[p] for p in at}
    return out, live & set(jaxpr.invars)


def _operands(eqn, reached: set):
    """The outputs of `eqn` the gradient reaches (for a `scan`, with the carries they feed
    back), and the positions of the operands it reaches from them: inside a scan or a call,
    through the equations of its body (by position: one variable passed at two positions may
    be reached at one only); any other equation (a `cond`, a custom derivative), every one."""
    body = inner_jaxpr(eqn)
    if body is None:
        return reached, range(len(eqn.invars))
    if eqn.primitive.name == "scan":
        consts, carries = scan_counts(eqn)
        if eqn.params["length"] == 0:  # (no step: each carry is returned as it came)
            return reached, [consts + j for j in reached if j < carries]
        while True:  # a carry the gradient reaches is reached at every iteration
            inner = _walk(body, reached)[1]
            more = {j for j in range(carries) if body.invars[consts + j] in inner}
            if more <= reached:
                break
            reached = reached | more
    else:
        inner = _walk(body, reached)[1]
    return reached, [p for p, w in enumerate(body.invars) if w in inner]


def _floating(var) -> bool:
    """Whether a gradient can flow through `var`: a floating-point variable with entries."""
    return isinstance(var, jcore.Var) and is_float(var) and not _empty(var)


def _empty(var) -> bool:
    """Whether `var` (a variable or a literal) has no entries."""
    return math.prod(getattr(var.aval, "shape", ())) == 0


def batched(jaxpr, batched_in) -> tuple[set, dict]:
    """The variables of `jaxpr` that differ between examples under `jax.vmap`, given which of
    its inputs do (`batched_in`, in its inputs' order), and ``{equation index: which inputs of
    its body do}`` for each scan or call walked into. Sound where it says a variable differs:
    an operation's output differs where an operand does, and an operation with a body follows
    `jax.vmap`'s own rule for it (a scan's or a `while`'s carries with what their steps feed
    back, a `cond`'s outputs every branch's or, for an index that differs, all, a custom
    derivative's its primal function's); of one with a body not known here, none is taken to.
    """
    varying = {v for v, b in zip(jaxpr.invars, batched_in, strict=True) if b}
    bodies: dict = {}
    for index, eqn in enumerate(jaxpr.eqns):
        ins = [isinstance(v, jcore.Var) and v in varying for v in eqn.invars]
        if any(ins):
            outs = _varying_outputs(eqn, ins, bodies, index)
            varying |= {v for v, b in zip(eqn.outvars, outs, strict=True) if b}
    return varying, bodies


def _varying_outputs(eqn, ins: list, bodies: dict, index: int) -> list:
    """Which outputs of `eqn` differ between examples, given which operands do (`ins`, not
    all False); a scan's or a call's body inputs go into `bodies`."""
    name, params = eqn.primitive.name, eqn.params
    outs = lambda jaxpr, flags: [_in(v, batched(jaxpr, flags)[0]) for v in jaxpr.outvars]  # noqa: E731
    body = inner_jaxpr(eqn)
    if body is not None:
        if name == "scan":
            consts, carries = scan_counts(eqn)
            while True:  # a carry that differs after a step differs at every step
                fed = [consts + j for j, b in enumerate(outs(body, ins)[:carries]) if b]
                if all(ins[i] for i in fed):
                    break
                ins = [b or i in fed for i, b in enumerate(ins)]
        bodies[index] = ins
        return outs(body, ins)
    if name == "cond":
        if ins[0]:  # (the branch taken differs: every output is selected per example)
            return [True] * len(eqn.outvars)
        each = [outs(branch.jaxpr, ins[1:]) for branch in params["branches"]]
        return [any(flags) for flags in zip(*each, strict=True)]
    if name in ("custom_jvp_call", "custom_vjp_call"):
        return outs(params["call_jaxpr"].jaxpr, ins)
    if name == "while":
        c, b = params["cond_nconsts"], params["body_nconsts"]
        carry = ins[c + b :]
        while True:
            step = outs(params["body_jaxpr"].jaxpr, ins[c : c + b] + carry)
            if all(x or not y for x, y in zip(carry, step, strict=True)):
                break
            carry = [x or y for x, y in zip(carry, step, strict=True)]
        if any(outs(params["cond_jaxpr"].jaxpr, ins[:c] + carry)):
            return [True] * len(eqn.outvars)
        return carry
    if has_body(eqn):
        return [False] * len(eqn.outvars)  # (a body not known here: see `batched`)
    return [True] * len(eqn.outvars)


def has_body(eqn) -> bool:
    """Whether `eqn` runs a jaxpr of its own (a call, a loop, a branch, a custom rule)."""
    return any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in _flat(eqn.params.values()))


def _in(v, variables: set) -> bool:
    return isinstance(v, jcore.Var) and v in variables


def _flat(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _flat(v)
        else:
            yield v


def inner_jaxpr(eqn):
    """The jaxpr of a scan's body or of a call walked into (`sub_jaxpr`; its inputs in the
    order of the equation's operands), else None."""
    if eqn.primitive.name == "scan":
        return eqn.params["jaxpr"].jaxpr
    called = sub_jaxpr(eqn)
    return None if called is None else called[0]
