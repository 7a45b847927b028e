r"""Each example's gradient norm from the tapped pass: every leaf's squared norm by its route
(`_plans.route`), as terms, and all of them added.

The tapped pass keeps every record and output gradient `_interpret.scaled`: divided by a
power of two near its largest magnitude, per layer and example, with that power's exponent.
A use's factors built from them (`_factors`) are then in [-1, 1], so that no Gram or product
of them overflows, and the products that flush are below ``2**-126`` of their largest: each
term is exact to rounding, at every magnitude. A leaf's squared norm over a group of its uses
(those whose cross terms count) is

.. math:: \sum_{u, v} s_u s_v \langle g_u, g_v \rangle, \qquad
          \langle g_u, g_v \rangle = t_{uv}\, 2^{k_u + k_v}

where ``s_u`` is the number the use's view scales the leaf by, ``t_uv`` the pair's term on
the normalized factors (`_factors.pair_term`, `_factors.self_term`) and ``k_u`` the sum of
its factors' exponents. A materialised leaf's is its normalized per-example gradient's sum of
squares. Every term is carried with its power of two and all of them are added at the
largest (`combine`): nothing leaves float32's range. A term that is 0 does not set that
scale (the others would flush), and the cross terms of a use whose own term is 0 are 0 (its
gradient is). An example with a record or output gradient that is not finite has a NaN norm.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optclip.norms import _reductions
from optclip.per_example.ghost import _convs, _factors, _interpret, _pieces, _plans, _rules
from optclip.per_example.ghost._plans import Mode, Route
from optclip.per_example.ghost._target import Target

# The per-example multiply-adds of the Grams above which, on a CPU, the norms are taken one
# example at a time (each example's Grams while its factors are in the cache).
LOOP_WORK = 2**23
ZERO = _factors.ZERO_EXPONENT


def accumulation(t: _interpret.Tapped):
    """The dtype every norm is accumulated in (float32, or float64 for float64 leaves)."""
    return _reductions.widest_accum_dtype([x.dtype for x in t.leaves] or [jnp.float32])


def aligned(site, x, e):
    """A record or output gradient `x` of `site` (laid out ``(*levels, B, ...)``) and its
    exponents `e` (``(*levels, B)``), the levels at which the site's view is the same at
    every iteration (a weight applied at every step of its scan, whose uses are summed) brought
    to their largest exponent (a multiply by a power of two <= 1), so that one exponent holds
    for all of them: ``(x, e)`` with `e` shaped ``(L, B)``, ``L`` the sliced levels. Levels
    whose exponents the tapped pass took as one already (size 1, `_interpret.exponents_of`)
    are left as they are."""
    sliced = _factors.sliced_levels(site)
    const = tuple(i for i, s in enumerate(sliced) if not s and e.shape[i] > 1)
    if const:
        top = jnp.max(e, axis=const, keepdims=True)
        x, e = _factors.brought_to(x, e, top), top
    return x, e.reshape(-1, e.shape[-1])


def use_factors(plan, t: _interpret.Tapped, acc) -> list:
    """A ghost leaf's uses' factors and their exponents: per use, ``[(x, ex, y, ey)]``, one
    per piece of its output gradient (`_pieces.Pieces`, for a use alone in its group: its
    terms are separable along the pieces) or one, each aligned to the first use's layout."""
    alone = {group[0] for group in plan.groups if len(group) == 1}
    out = []
    for i, use in enumerate(plan.uses):
        site = use.site
        r, er = aligned(site, *t.records[site.records[0]]) if site.records else (None, None)
        grad = t.grads[site.id][0]
        if isinstance(grad, _pieces.Pieces):
            parts = grad.parts if i in alone else (_pieces.joined(grad, site.depth + 1),)
        else:
            parts = (grad,)
        tuples = []
        for part in parts:
            g, eg = aligned(site, *part)
            x, y = _rules.of(site).factors(site, r, g, acc)
            ex = 0 * eg if er is None else er
            tuples.append((y, eg, x, ex) if use.swapped else (x, ex, y, eg))
        out.append(tuples)
    return out


def joined_shapes(plan, uses) -> list:
    """Each use's factors' shapes ``(x, y)`` as if its pieces were joined (`_plans.route`)."""
    out = []
    for use, tuples in zip(plan.uses, uses, strict=True):
        x, _, y, _ = tuples[0]
        width = sum((t[0] if use.swapped else t[2]).shape[4] for t in tuples)
        if use.swapped:
            out.append(((*x.shape[:4], width), y.shape))
        else:
            out.append((x.shape, (*y.shape[:4], width)))
    return out


def _number(scale, acc):
    """A use's number as ``(m, k)``, ``scale = m * 2**k``: Python numbers for a float, arrays
    for a traced one (`m` taken from the number itself, times exact powers of two, so that a
    gradient with respect to it passes; NaN where it is not finite)."""
    if isinstance(scale, float):
        return math.frexp(scale)
    s = scale.astype(jnp.promote_types(scale.dtype, jnp.float32))
    k = _factors.exponent(jnp.abs(lax.stop_gradient(s)))
    k = jnp.where(k == ZERO, 0, k)
    low, high = _factors.powers_of_two(-k, s.dtype)
    return jnp.where(jnp.isfinite(s), (s * low) * high, jnp.nan).astype(acc), k


def leaf_terms(plan, uses, route: Route, acc) -> list:
    """A ghost leaf's terms ``[(value, exponent)]`` (``(L, B)`` each: ``value * 2**exponent``
    added up is its squared norm), from its uses' factors (`use_factors`)."""
    out = []
    for group in plan.groups:
        if len(group) == 1:  # (one use: a term per piece, whose cross terms are 0)
            blocks = [(group, [piece]) for piece in uses[group[0]]]
        else:
            blocks = [(group, [uses[i][0] for i in group])]
        for indices, chosen in blocks:
            out += _group_terms(plan, indices, chosen, route, acc)
    return out


def _group_terms(plan, group, chosen, route: Route, acc) -> list:
    """The terms of the uses `group` (their factors `chosen`), cross terms included."""
    out = []
    numbers = [_number(plan.scales[i], acc) for i in group] if plan.scales else None
    ks = [ex + ey for _, ex, _, ey in chosen]
    if numbers:
        ks = [k + n for k, (_, n) in zip(ks, numbers, strict=True)]
    own = {}
    for i, (x, _, y, _) in enumerate(chosen):
        # (a ``PRODUCT`` leaf whose product the tapped pass did not form: its direct product)
        own[i] = _factors.self_term(x, y, acc, route in (Route.DIRECT, Route.PRODUCT))
    for i, j in itertools.combinations_with_replacement(range(len(chosen)), 2):
        if i == j:
            value = own[i]
        else:  # (a use whose own term is 0 has a zero gradient: so are its cross terms)
            x1, _, y1, _ = chosen[i]
            x2, _, y2, _ = chosen[j]
            cross = 2 * _factors.pair_term(x1, y1, x2, y2, acc)
            value = jnp.where((own[i] == 0) | (own[j] == 0), 0, cross)
        if numbers:
            for m in (numbers[i][0], numbers[j][0]):
                value = value if isinstance(m, float) and m == 1.0 else value * m
        out.append((value, ks[i] + ks[j]))
    return out


def _flagged(exponents) -> jax.Array:
    """Per example: whether any of `exponents` (``(L, B)`` arrays) marks a value not finite."""
    return jnp.any(
        jnp.concatenate([e.reshape(-1, e.shape[-1]) for e in exponents]) >= _interpret.FLAGGED,
        axis=0,
    )


def added(terms, acc):
    """`terms` ``[(value, exponent)]`` (``(L, B)`` each) added, per example, at the largest
    exponent among the terms that are not 0 (each shifted by a power of two <= 1): ``(total,
    top)``, the sum ``total * 2**top`` (`top` 0 where every term is 0)."""
    values = jnp.concatenate([v.astype(acc).reshape(-1, v.shape[-1]) for v, _ in terms])
    exponents = jnp.concatenate(
        [jnp.broadcast_to(e, v.shape).reshape(-1, v.shape[-1]) for v, e in terms]
    )
    exponents = jnp.where(exponents >= _interpret.FLAGGED, 0, exponents)
    counted = jnp.where(values == 0, ZERO, exponents)
    top = jnp.max(counted, axis=0)
    shift = jnp.where(top == ZERO, 0, jnp.maximum(counted - top, 2 * ZERO))
    first, second = _factors.powers_of_two(shift, acc)
    total = jnp.maximum(jnp.sum((values * first) * second, axis=0), 0)
    return total, jnp.where(top == ZERO, 0, top)


def combine(terms, flagged, acc):
    """The examples' norms (shape (B,)) from `terms` ``[(value, exponent)]`` (``(L, B)``
    each), `added`; NaN where `flagged`."""
    total, top = added(terms, acc)
    odd = top & 1  # (``2**top`` is ``2**odd`` under the root, ``2**(top // 2)`` outside it)
    first, second = _factors.powers_of_two((top - odd) >> 1, acc)
    norms = (root(total * (1 + odd).astype(acc)) * first) * second
    return jnp.where(flagged, jnp.asarray(jnp.nan, acc), norms)


def root(total):
    """``sqrt(total)``, its derivative 0 where `total` is 0 (not NaN: the gradient through
    `clipped_grad` passes through the norms)."""
    zero = total == 0
    return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, total))).astype(total.dtype)


def materialised(plans, t: _interpret.Tapped):
    """Every materialised leaf's per-example gradient as one ``(B, N)`` array (None where none
    is materialised)."""
    grads = [t.example_grads[k].reshape(t.size, -1) for k in _plans.materialised(plans)]
    if not grads:
        return None
    return grads[0] if len(grads) == 1 else jnp.concatenate(grads, axis=1)


def _materialised_term(grads, acc):
    """The materialised leaves' term ``(value, exponent)`` (``(1, B)``): their per-example
    gradients `grads` (`materialised`) divided by a power of two near each example's largest
    magnitude inside their sum of squares (exact at every magnitude, no copy); and whether
    each example's are not finite."""
    f = _factors.squares(grads, acc)
    e = _factors.exponent(lax.stop_gradient(_factors.magnitude(f)))
    bad = e > jnp.finfo(acc).maxexp
    e = jnp.where(bad | (e == ZERO), 0, e)
    value = jnp.sum(jnp.square(_factors.divided(f, e).values), axis=(2, 3, 4))
    return (value, 2 * e), bad[0]


class Product(NamedTuple):
    """A ``PRODUCT`` leaf's per-example gradient (`_convs.conv_products`, ``(B, H, S, F)``),
    its record and output gradient normalized, the power of two they were divided by
    (`exponent`, ``(B,)``), and whether either was not finite (`flagged`)."""

    values: jax.Array
    exponent: jax.Array
    flagged: jax.Array


def _shapes(plans, t: _interpret.Tapped, acc) -> list:
    """`joined_shapes` of each of `plans` (ghost leaves), traced by `jax.eval_shape`: no
    factor is formed."""
    shapes: list = []
    jax.eval_shape(lambda: shapes.extend(joined_shapes(p, use_factors(p, t, acc)) for p in plans))
    return shapes


def route(plan, t: _interpret.Tapped, acc):
    """A ghost leaf's `_plans.route`, from its factors' shapes."""
    return _plans.route(plan, _shapes([plan], t, acc)[0])


def products(plans, t: _interpret.Tapped) -> dict:
    """``{leaf: Product}`` of the leaves whose route is ``PRODUCT``, formed from the tapped
    pass's records and output gradients (the tapped pass keeps them: `Tapped.products`)."""
    acc = accumulation(t)
    out = {}
    for i, plan in enumerate(plans):
        if plan.mode is not Mode.GHOST or route(plan, t, acc) is not Route.PRODUCT:
            continue
        site = plan.uses[0].site
        record, er = t.records[site.records[0]]
        (grad,) = t.grads[site.id]
        if isinstance(grad, _pieces.Pieces):
            grad = _pieces.joined(grad, site.depth + 1)
        g, eg = grad
        values = _convs.conv_products(site, record, g, acc)
        out[i] = Product(values, er + eg, _flagged([er[None], eg[None]]))
    return out


def _terms(plans, t: _interpret.Tapped, acc):
    """Every leaf's terms but the ``PRODUCT`` leaves', and the examples flagged."""
    terms, exponents, flagged = [], [], jnp.zeros((t.size,), bool)
    grads = materialised(plans, t)
    if grads is not None:
        term, flagged = _materialised_term(grads, acc)
        terms.append(term)
    for i, plan in enumerate(plans):
        if plan.mode is not Mode.GHOST or i in t.products:
            continue
        uses = use_factors(plan, t, acc)
        found = _plans.route(plan, joined_shapes(plan, uses))
        assert found is not None  # (a ghost leaf)
        terms += leaf_terms(plan, uses, found, acc)
        exponents += [e for tuples in uses for _, ex, _, ey in tuples for e in (ex, ey)]
    if exponents:
        flagged |= _flagged(exponents)
    return terms, flagged


def _gram_work(plans, t, acc) -> int:
    """The multiply-adds of one example's Grams (every ghost use's own, ``L H K^2 (Sx +
    Sy)``; the ``PRODUCT`` leaves' none), from the shapes of its factors."""
    ghost = [p for i, p in enumerate(plans) if p.mode is Mode.GHOST and i not in t.products]
    uses = [use for shapes in _shapes(ghost, t, acc) for use in shapes]
    return sum(x[0] * x[2] * x[3] * x[3] * (x[4] + y[4]) for x, y in uses)


def norms(plans, t: _interpret.Tapped, target: Target) -> jax.Array:
    """The examples' norms (shape (B,)): on a CPU one example at a time where one example's
    Grams take at least `LOOP_WORK` multiply-adds (below that the loop's iterations cost more
    than they save), else the whole batch at once (a GPU would serialise the loop). A
    ``PRODUCT`` leaf's term is its per-example gradient's sum of squares, over the batch."""
    acc = accumulation(t)
    terms, flagged = [], jnp.zeros((t.size,), bool)
    for p in t.products.values():
        terms.append((jnp.sum(jnp.square(p.values), axis=(1, 2, 3))[None], 2 * p.exponent[None]))
        flagged |= p.flagged
    if t.one_by_one and _gram_work(plans, t, acc) >= LOOP_WORK and target.cpu:

        def one(b):  # (the example's terms added: one term per example)
            found, bad = _terms(plans, t.example(b), acc)
            total, top = (
                added(found, acc) if found else (jnp.zeros((1,), acc), jnp.zeros((1,), jnp.int32))
            )
            return total[0], top[0], bad[0]

        total, top, bad = lax.map(one, jnp.arange(t.size))
        terms.append((total[None], top[None]))
        flagged |= bad
    else:
        found, bad = _terms(plans, t, acc)
        terms += found
        flagged |= bad
    if not terms:
        return jnp.zeros((t.size,), acc)
    return combine(terms, flagged, acc)
