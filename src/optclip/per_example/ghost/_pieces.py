"""Output gradients made of windows of taps, kept as their pieces rather than joined.

A product split into gates whose parts are added to parts of another product (a GRU cell as
Equinox writes it: ``i_r + h_r``, ``i_z + h_z``) has an output gradient made of slices of the
other product's tap beside a tap of its own (`_shared.place`). Joined, that gradient is a new
array as large as the product's output at every step. Kept as pieces, each tap is cut where
any site's slices of it start or stop, and every piece is scaled once (its own exponent, so
exact at every magnitude) and read by every site it is part of: the input product reads all
of its tap's pieces, the state product two of them and its own tap. A dense site's norm and
sum are separable along its output's features (the squared norm is a sum over them, and the
weight gradient's columns are theirs), so each piece is a term of the norm and a block of
the sum (`_norms.use_factors`, `_sums.site_sum`); the Grams of a piece read by two sites are
one computation in the program.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optclip.per_example.ghost import _factors, _interpret, _shared, _sites


class Window(NamedTuple):
    """``transpose(tap[start:stop along axis], order)`` (one example's dimensions; `axis` None:
    the whole tap), where ``order[i]`` is the tap's dimension at the window's dimension ``i``."""

    tap: _shared.Tapped
    axis: Any
    start: int
    stop: int
    order: tuple


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts"], meta_fields=["axis"])
@dataclasses.dataclass(frozen=True)
class Pieces:
    """An output gradient as `parts` ``((array, exponent), ...)`` side by side along `axis`
    (one example's), each array laid out as the gradient is and scaled by its own exponent."""

    axis: int
    parts: tuple


def window(node, ndim: int) -> Window | None:
    """`node` (a `_shared` node of one example's `ndim` dimensions) as a `Window`, or None
    where it is not a slice along at most one dimension of one tap."""
    order: list = list(range(ndim))
    box: dict = {}
    while not isinstance(node, _shared.Tapped):
        if isinstance(node, _shared.Transposed):
            order = [node.permutation[d] for d in order]
            box = {node.permutation[d]: span for d, span in box.items()}
        elif isinstance(node, _shared.Sliced):
            start, stop = node.start, node.stop
            if node.axis in box:  # (a slice of a slice: the outer one's bounds inside it)
                start, stop = start + box[node.axis][0], start + box[node.axis][1]
            box[node.axis] = (start, stop)
        else:
            return None
        node = node.of
    if len(box) > 1:
        return None
    axis, (start, stop) = next(iter(box.items())) if box else (None, (0, 0))
    return Window(node, axis, start, stop, tuple(order))


def site_windows(node, ndim: int):
    """``(axis, [Window])``: a `_shared.Split` of windows, along `axis`, adjacent windows of one
    tap merged; None for any other node."""
    if not isinstance(node, _shared.Split):
        return None
    out: list = []
    for part in node.parts:
        w = window(part, ndim)
        if w is None or w.axis is None and any(w.tap == o.tap for o in out):
            return None
        last = out[-1] if out else None
        if last and w.axis is not None and last[:2] == w[:2] and last.order == w.order:
            if last.stop == w.start:
                out[-1] = last._replace(stop=w.stop)
                continue
        out.append(w)
    return node.axis, out


def _windows(node, ndim: int):
    """`site_windows`, or a slice of one tap (`window`) as one window along its sliced axis."""
    split = site_windows(node, ndim)
    if split is None:
        w = window(node, ndim)
        split = None if w is None or w.axis is None else (w.order.index(w.axis), [w])
    return split


def features(site) -> tuple:
    """The dimensions of `site`'s output (one example's) along which its norm and sum are
    separable: a dense site's view's own (its weight's free dimensions); none elsewhere."""
    if site.kind is not _sites.Kind.DENSE or len(site.views) != 1:
        return ()
    return _factors.dense_dims(site.eqn, site.views[0][0])[4]


def cuts(sites, placed: _shared.Placement) -> dict:
    """``{tap: (axis, bounds)}``: each tap that some site reads in pieces (`site_windows`, its
    axis among the site's `features`), cut at every bound its windows start or stop at, and at
    its ends (all along one of the tap's dimensions; a tap sliced along two is not cut)."""
    found: dict = collections.defaultdict(set)
    for i, nodes in placed.gradients.items():
        ndim = len(sites[i].eqn.outvars[0].aval.shape)
        split = _windows(nodes[0], ndim) if len(nodes) == 1 else None
        if split is None or split[0] not in features(sites[i]):
            continue
        for w in split[1]:  # (a slice along the dimension the site's parts are side by side)
            if w.axis is not None and w.order[split[0]] == w.axis:
                found[w.tap].add((w.axis, w.start, w.stop))
    out = {}
    for tap, spans in found.items():
        axes = {a for a, _, _ in spans}
        if len(axes) == 1:
            axis = axes.pop()
            size = placed.shapes[tap.site][tap.slot].shape[axis]
            bounds = {0, size} | {b for _, start, stop in spans for b in (start, stop)}
            out[tap] = (axis, sorted(bounds))
    return out


def pieces_of(site, node, ndim: int, cut: dict, piece) -> Pieces | None:
    """`site`'s output gradient `node` as `Pieces` of the cut taps (`cuts`), `piece(tap,
    axis, start, stop)` giving each piece's ``(array, exponent)`` in the tap's layout; None
    where it is not read in pieces (a whole tap that is not cut, or along a dimension that is
    not among the site's `features`)."""
    split = _windows(node, ndim)
    if split is None:
        w = window(node, ndim)
        if w is None or w.tap not in cut:
            return None
        split = (w.order.index(cut[w.tap][0]), [w])
    axis, windows = split
    if axis not in features(site):
        return None
    parts: list = []
    for w in windows:
        bounds = cut.get(w.tap)
        if w.axis is None and bounds is None:
            parts.append(_ordered(piece(w.tap, None, 0, 0), w.order))
            continue
        if bounds is None or w.order[axis] != bounds[0] or w.axis not in (None, bounds[0]):
            return None
        tap_axis, points = bounds
        start, stop = (points[0], points[-1]) if w.axis is None else (w.start, w.stop)
        inside = [b for b in points if start <= b <= stop]
        for lo, hi in zip(inside, inside[1:], strict=False):
            parts.append(_ordered(piece(w.tap, tap_axis, lo, hi), w.order))
    return Pieces(axis, tuple(parts))


def _ordered(pair, order):
    """A piece ``(array, exponent)`` (laid out ``(*lead, ...)``) in a window's `order`."""
    x, e = pair
    lead = x.ndim - len(order)
    if order == tuple(range(len(order))):
        return x, e
    return jnp.transpose(x, (*range(lead), *(lead + d for d in order))), e


def joined(pieces: Pieces, lead: int):
    """The pieces side by side as one ``(array, exponent)``: each brought to their largest
    exponent (`_factors.brought_to`), for a reader that cannot take them apart. A piece with
    an entry not finite makes the largest `_interpret.FLAG`: the joined gradient is flagged,
    as one scaled whole would be."""
    top = functools.reduce(jnp.maximum, [e for _, e in pieces.parts])
    arrays = [_factors.brought_to(x, e, top) for x, e in pieces.parts]
    return lax.concatenate(arrays, lead + pieces.axis), top


def scale(x, axis: int, sliced, e=None):
    """``(x scaled, its exponents)`` (`_interpret.scaled`), the exponents `e` where given (a
    tap's outside scans, taken in the backward pass: exact floats) or `_interpret.exponents_of`."""
    e = _interpret.exponents_of(x, axis, sliced) if e is None else e.astype(jnp.int32)
    return _interpret.scaled(x, e), e


def scaled_gradients(sites, placed: _shared.Placement, grads: dict) -> dict:
    """Every tapped site's output gradients (``{site id: tuple}``) from the taps' gradients
    `grads` (``{site id: tuple of (array, exponent)}``): `Pieces` of the cut taps (`cuts`)
    where the site reads them so, else ``(array, exponent)``: a tap scaled whole, or an output
    gradient made of several taps joined and scaled. Each tap or piece is scaled once, for
    every site that reads it."""
    cut = cuts(sites, placed)
    once: dict = {}

    def piece(site, tap, axis, start, stop):
        sliced = _factors.sliced_levels(site)
        g, e = grads[tap.site][tap.slot]
        if axis is None:
            if (tap, sliced) not in once:
                once[tap, sliced] = scale(g, site.depth, sliced, None if site.depth else e)
            return once[tap, sliced]
        at = site.depth + 1 + axis
        if (tap, axis, sliced) not in once:  # (every piece's exponent from one reduction)
            bounds = tuple(cut[tap][1])
            exponents = exponents_apart(g, site.depth, sliced, bounds, at)
            once[tap, axis, sliced] = dict(zip(zip(bounds, bounds[1:]), exponents))
        e = once[tap, axis, sliced][start, stop]
        if (tap, axis, start, stop, sliced) not in once:
            part = lax.slice_in_dim(g, start, stop, axis=at)
            once[tap, axis, start, stop, sliced] = _interpret.scaled(part, e), e
        return once[tap, axis, start, stop, sliced]

    def gradient(site, node, alone):
        ndim = len(site.eqn.outvars[0].aval.shape)
        parts = pieces_of(site, node, ndim, cut, lambda *w: piece(site, *w)) if alone else None
        if parts is not None:
            return parts
        if not isinstance(node, _shared.Tapped):  # (made of several: one exponent for all)
            raw = {i: tuple(g for g, _ in pairs) for i, pairs in grads.items()}
            joined = _shared.gradient(node, raw, site.depth + 1)
            return scale(joined, site.depth, _factors.sliced_levels(site))
        return piece(site, node, None, 0, 0)

    return {
        i: tuple(gradient(sites[i], node, len(nodes) == 1) for node in nodes)
        for i, nodes in placed.gradients.items()
    }


@functools.partial(jax.jit, static_argnames=("axis", "sliced", "bounds", "at"))
def exponents_apart(x, axis: int, sliced: tuple, bounds: tuple, at: int):
    """`_interpret.exponents_of` of each piece of `x` between consecutive `bounds` along its
    dimension `at`, from one reduction of `x` (in blocks of the bounds' common divisor), not
    one of each slice: a slice read by its exponent's reduction and its scaled copy is a copy
    of its own."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or not x.size:
        return [jnp.zeros(x.shape[: axis + 1], jnp.int32) for _ in bounds[1:]]
    step = math.gcd(*bounds)
    lead, before = x.shape[: axis + 1], math.prod(x.shape[axis + 1 : at])
    rows = (before,) if before > 1 else ()  # (no size-1 dimension reduced beside others)
    blocks = x.reshape(*lead, *rows, x.shape[at] // step, step * math.prod(x.shape[at + 1 :]))
    blocks = lax.optimization_barrier(blocks)  # (else XLA folds the reshape back: as slow as
    # `_interpret._largest_magnitudes` says of a reduction over ``(..., S, 1)``)
    m = jnp.max(jnp.abs(blocks), axis=(axis + 1, axis + 3) if rows else axis + 2)
    parts = [
        jnp.max(m[..., lo // step : hi // step], axis=-1) for lo, hi in zip(bounds, bounds[1:])
    ]
    return [_interpret.exponents_of(part, axis, sliced) for part in parts]  # (of the maxima)
