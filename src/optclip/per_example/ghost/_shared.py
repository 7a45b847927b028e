"""Where the tapped pass taps: the variables whose gradients make up the sites' output
gradients, each tapped once however many sites read it.

A site's output gradient is the gradient of its output variable, and any variable's gradient
can be taken by a tap on it. An output used once, by an `add` of two operands of its own shape
and dtype, has the gradient of that sum; one used once by a `split`, its parts' gradients side
by side; one used once by a `transpose`, the transposed one's transposed back. Conversely a
part's gradient is a slice of the split variable's, and a transposed variable's the
transpose of the other's.

The sites are taken in order. A site whose output leads only to variables no earlier tap
gives is tapped at its output, whole: its gradient is the tap's, and every variable its
output leads to is then a slice or a transpose of it. A site whose output leads to some of
them has its gradient made of those, with taps only on the parts no earlier site gives.
An LSTM cell as Equinox and Flax write it adds its input's and its state's products before
the gates (``W_i x + b + W_h h``): one tap serves both products. A GRU cell as Equinox and
dm-haiku write it splits each product into the gates and adds parts of them (``i_r + h_r``,
``i_z + h_z``, but ``i_n + r * (h_n + b_n)``): the input's product is tapped whole, and the
state's product's gradient is two slices of that tap beside a tap of its third part. In a scan
as long as the sequence, one stack of output gradients is kept per tap, not one per product.

A site with more than one floating output is tapped at its outputs, as they are.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from optclip.per_example.ghost import _interpret, _jaxprs, _sites

SUMS = frozenset({"add", "add_any"})


class Spot(NamedTuple):
    """A tapped variable: its tap is ``taps[site][slot]``, inside `depth` scans; `batched`
    when it differs between examples (else its tap is added, as `_trace.batched_sites`
    explains); `pinned` when its output gradient is held row-major (`weight_first`)."""

    site: int
    slot: int
    depth: int
    batched: bool
    pinned: bool = True


class Tapped(NamedTuple):
    """A tapped variable's gradient: ``taps[site][slot]``'s, as its `Spot` says."""

    site: int
    slot: int


class Split(NamedTuple):
    """The gradient of a variable split along `axis`: its `parts`' gradients side by side."""

    axis: int
    parts: tuple


class Sliced(NamedTuple):
    """A part's gradient: ``[start:stop]`` along `axis` of the split variable's (`of`)."""

    axis: int
    start: int
    stop: int
    of: Any


class Transposed(NamedTuple):
    """`of` transposed by `permutation` (of one example's axes)."""

    permutation: tuple
    of: Any


class Placement(NamedTuple):
    """`at`: ``{variable: Spot}``, every tapped variable (of any of the nested jaxprs: a
    variable is one object); `shapes`: ``{site id: tuple of ShapeDtypeStruct}``, one
    example's variables that each site's taps are for (not stacked along scans); `gradients`:
    ``{site id: tuple of Tapped, Split, Sliced or Transposed}``, how each floating output's
    gradient is made of the tapped variables'; `kept`: the variables of scans' steps that the
    backward pass reads rather than computes again (`_interpret.SCAN_SAVES`): where the
    output gradients of the step's tapped sites are taken (the sums, parts and transposes of
    their outputs that their paths end at), and the outputs of its other products."""

    at: dict
    shapes: dict
    gradients: dict
    kept: set


def place(jaxpr, plan, sites, batched) -> Placement:
    """The `Placement` of the taps of `sites` (``{id: site}``, the tapped ones) of `plan` in
    `jaxpr` and the jaxprs it calls; `batched`: the ids of the sites whose operands differ
    between examples."""
    out = Placement({}, {i: () for i in sites}, {}, set())
    _place(jaxpr, plan, sites, batched, out, scanned=False)
    return out


class _Path(NamedTuple):
    """Where a variable's gradient comes from: `var` itself (`kind` None) or its only use, a
    `split` or a `transpose` (`param`: its axis or permutation) of which `paths` are the
    outputs'."""

    var: Any
    kind: Any = None
    param: Any = None
    paths: tuple = ()

    def leaves(self) -> list:
        return [self.var] if self.kind is None else [v for p in self.paths for v in p.leaves()]

    def vars(self) -> list:
        return [self.var, *(v for p in self.paths for v in p.vars())]


def _uses(jaxpr) -> tuple[collections.Counter, dict]:
    """How many times each variable of `jaxpr` is read (an output of `jaxpr` twice more: its
    gradient comes from outside, never followed), and its last reader."""
    users: collections.Counter = collections.Counter()
    consumer: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                users[v] += 1
                consumer[v] = eqn
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            users[v] += 2
    return users, consumer


def _place(jaxpr, plan, sites, batched, out: Placement, scanned: bool) -> None:
    users, consumer = _uses(jaxpr)

    def sum_of(v):
        """The variable whose gradient `v`'s is: `v` followed through every `add` that is its
        only use and adds two operands of its shape and dtype."""
        while users[v] == 1 and consumer[v].primitive.name in SUMS:
            eqn = consumer[v]
            avals = [(x.aval.shape, x.aval.dtype) for x in (*eqn.invars, *eqn.outvars)]
            if len(eqn.invars) != 2 or any(a != (v.aval.shape, v.aval.dtype) for a in avals):
                break
            v = eqn.outvars[0]
        return v

    def follow(v) -> _Path:
        """`v`'s gradient's `_Path`: through sums, then a `split` or a `transpose` that is
        its only use (every output of it used: an unused part's gradient is zeros)."""
        v = sum_of(v)
        eqn = consumer.get(v) if users[v] == 1 else None
        if eqn is None or any(isinstance(o, jcore.DropVar) for o in eqn.outvars):
            return _Path(v)
        if eqn.primitive.name == "split":
            return _Path(v, Split, eqn.params["axis"], tuple(follow(o) for o in eqn.outvars))
        if eqn.primitive.name == "transpose":
            return _Path(v, Transposed, eqn.params["permutation"], (follow(eqn.outvars[0]),))
        return _Path(v)

    here = sorted((s for s in plan.sites.values() if s.id in sites), key=lambda s: s.id)
    paths: dict = {}  # {site id: its one output's `_Path`}
    through: dict = collections.defaultdict(set)  # {variable: the sites whose paths reach it}
    for site in here:
        if len(site.eqn.outvars) == 1 and _interpret.float_outputs(site.eqn) == [0]:
            paths[site.id] = follow(site.eqn.outvars[0])
            for v in paths[site.id].vars():
                through[v].add(site.id)
    given: dict = {}  # {variable: the node that gives its gradient}

    def give(path: _Path, node) -> None:
        """Records that `node` gives `path.var`'s gradient, and so every variable below."""
        given.setdefault(path.var, node)
        if path.kind is Split:
            start = 0
            for p in path.paths:
                stop = start + p.var.aval.shape[path.param]
                give(p, Sliced(path.param, start, stop, node))
                start = stop
        elif path.kind is Transposed:
            give(path.paths[0], transposed(path.param, node))

    def node_of(path: _Path, site, ordered: bool = True):
        """`path.var`'s gradient from what earlier taps give, with taps of `site` on what
        they do not: whole where they give nothing below. `ordered`: no transpose above."""
        if path.var in given:
            return given[path.var]
        leaves = path.leaves()
        if path.kind is None or not any(v in given for v in leaves):
            node = _spot(path.var, site, through, batched, out, ordered)
            give(path, node)
            return node
        ordered = ordered and path.kind is not Transposed
        below = tuple(node_of(p, site, ordered) for p in path.paths)
        if path.kind is Split:
            return Split(path.param, below)
        return transposed(tuple(path.param.index(d) for d in range(len(path.param))), below[0])

    for site in here:
        if site.id in paths:
            out.gradients[site.id] = (node_of(paths[site.id], site),)
            ends = paths[site.id].leaves()
        else:  # (tapped at its outputs)
            ends = [site.eqn.outvars[j] for j in _interpret.float_outputs(site.eqn)]
            out.gradients[site.id] = tuple(_spot(v, site, through, batched, out) for v in ends)
        out.kept.update(ends if scanned else ())
    out.kept.update(_other_products(jaxpr, plan, sites) if scanned else ())
    for index, sub in plan.subplans.items():
        eqn = jaxpr.eqns[index]
        inner = eqn.params["jaxpr"].jaxpr if eqn.primitive.name == "scan" else None
        inner = inner if inner is not None else (_jaxprs.sub_jaxpr(eqn) or (None,))[0]
        if inner is not None:
            _place(inner, sub, sites, batched, out, scanned or eqn.primitive.name == "scan")


def _other_products(jaxpr, plan, sites) -> list:
    """The outputs of `jaxpr`'s products (`_jaxprs.PRODUCTS`) that are not tapped sites, and
    of those in the calls it makes that `_place` does not walk into (no sites inside)."""
    tapped = {index for index, site in plan.sites.items() if site.id in sites}
    out = []
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name in _jaxprs.PRODUCTS and i not in tapped:
            out += eqn.outvars
        elif i not in plan.subplans:
            out += _jaxprs.call_products(eqn)
    return out


def transposed(permutation, node):
    """`Transposed`, two of them in a row composed, none where the order is unchanged."""
    if isinstance(node, Transposed):
        permutation, node = tuple(node.permutation[d] for d in permutation), node.of
    return node if permutation == tuple(range(len(permutation))) else Transposed(permutation, node)


def weight_first(site) -> bool:
    """Whether `site` is a product whose weight is its first operand (``W @ x``, as Equinox
    writes a layer). Batched by `jax.vmap`, it gives the weight's dimensions before the
    examples', the order XLA lays its output out in. Its output gradient, and one of a sum or
    a part of that output, is then left to XLA's layout assignment (`Spot.pinned` False):
    held row-major, the examples' dimension first, XLA transposed it into a copy of its own.
    Every other tap is held row-major (`_interpret.tap`)."""
    return site.kind is _sites.Kind.DENSE and site.views[0][0] == 0


def _spot(v, site, through, batched, out: Placement, ordered: bool = True) -> Tapped:
    """`v`'s tap: an existing one, or a new one of `site`'s (held row-major unless `site` is
    `weight_first` and `v` is its output, a sum or a part of it, not a transpose: `ordered`).
    A variable a site's path reaches follows from its output: it differs between examples if
    that output does."""
    pinned = not (ordered and weight_first(site))
    if v not in out.at:
        slot = len(out.shapes[site.id])
        readers = through.get(v) or {site.id}
        out.at[v] = Spot(site.id, slot, site.depth, bool(readers & batched), pinned)
        shape = jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        out.shapes[site.id] = (*out.shapes[site.id], shape)
    return Tapped(out.at[v].site, out.at[v].slot)


def gradient(node, grads, lead: int):
    """The output gradient `node` makes of the tapped variables' gradients `grads` (``{site
    id: tuple of arrays}``), each laid out with `lead` leading axes (the scans' and the
    examples')."""
    if isinstance(node, Tapped):
        return grads[node.site][node.slot]
    if isinstance(node, Split):
        return jnp.concatenate([gradient(p, grads, lead) for p in node.parts], lead + node.axis)
    if isinstance(node, Sliced):
        of = gradient(node.of, grads, lead)
        return lax.slice_in_dim(of, node.start, node.stop, axis=lead + node.axis)
    order = (*range(lead), *(lead + d for d in node.permutation))
    return jnp.transpose(gradient(node.of, grads, lead), order)
