"""How each parameter leaf's per-example norm and clipped sum are computed: its *route*.

A leaf goes ghost when every use is a closed-form site (`_sites.Kind`: dense, embed, conv, added)
and all of them share one layout (or its transpose: the input and output embeddings of a tied
model); its squared norm is then the sum over every pair of its uses (the cross terms
included, each use times the number its view scales the leaf by) and its clipped sum is
book-kept from the same records and output gradients. Uses of different single indices of a
dimension (``qkv[0]``, ``qkv[1]``) are orthogonal: no cross term. Any other leaf is
materialised: the tapped pass gives each example its own copy of that leaf, so that the
backward pass yields each example's gradient of it.

`route` is the one function that says which way a leaf goes (`Route`). `forced` (set with
`force_ghost_route`) overrides it for every leaf, to bisect a wrong number: a result that changes
when the route is forced points at the route it left.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from typing import Any, NamedTuple

from optclip import _checks
from optclip.per_example.ghost import _sites


class Mode(enum.Enum):
    GHOST = "ghost"
    MATERIALISED = "materialised"
    UNUSED = "unused"


class Route(enum.Enum):
    """How a used leaf's norm is computed (every route is exact at every magnitude: see
    `_norms`).

    * ``MATERIALISED``: from its per-example gradient, a sum of squares.
    * ``GRAMS``: ghost, by the Grams of its uses' factors, ``sum (X X'^T) * (Y Y'^T)`` (inner
      products where each use has one row per example).
    * ``DIRECT``: ghost, one use, ``||X^T Y||^2``: where that takes fewer operations than the
      Grams (the product per example is smaller than the factors).
    * ``PRODUCT``: ``DIRECT`` for a convolution outside scans whose per-example gradient is
      no larger than its output gradient: that product, formed once in the tapped pass window
      offset by window offset (no patches), gives the norm and the clipped sum, so that its
      output gradient is read once, as soon as it is formed.
    """

    MATERIALISED = "materialised"
    GRAMS = "grams"
    DIRECT = "direct"
    PRODUCT = "product"


FORCES = ("materialised", "grams", "direct")
_forced: list = [None]


@contextlib.contextmanager
def force_ghost_route(route: str | None):
    """Force how `clipped_grad` computes each leaf's norm, for bisecting a wrong number.

    Within this context every ghost step traced (``method="auto"``) takes `route` for every
    used leaf. Every route gives the same norms and clipped sums to float32 rounding, so a
    result that changes when the route is forced points at the route it left. A step already
    traced keeps its route; `ghost_report` run inside the context reports the forced one.

    Args:
      route: ``"materialised"`` (every leaf's per-example gradient formed, through the ghost
        engine's own passes), ``"grams"`` (every ghost leaf's norm from the Grams of its
        uses' inputs and output gradients, never their direct product), ``"direct"`` (the
        direct product for every ghost leaf of one use), or None (the engine's own choice).

    Raises:
      ValueError: `route` is none of these.

    Examples:
      >>> import jax, jax.numpy as jnp, optclip
      >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
      >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 5, 3))
      >>> with optclip.force_ghost_route("grams"):
      ...     step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))
      ...     grads = step(w, x)
      >>> print(grads.shape)
      (3, 2)
    """
    if route is not None:
        _checks.check_choice(route, "route", FORCES)
    before = _forced[0]
    _forced[0] = route
    try:
        yield
    finally:
        _forced[0] = before


def forced() -> str | None:
    """The route `force_ghost_route` set, or None."""
    return _forced[0]


class Use(NamedTuple):
    """One use of a leaf: its site, the operand position of the view, the view, and whether
    its factors are exchanged to match the first use's layout (a tied, transposed use)."""

    site: _sites.Site
    position: int
    view: Any
    swapped: bool = False


class LeafPlan(NamedTuple):
    """How one leaf's norm is computed: `mode`, its `uses`, the `groups` of uses whose cross
    terms count (indices into `uses`), each use's number (`scales`: its view's
    `_views.View.scale`, a float or traced; None where every use's is 1), and why."""

    mode: Mode
    uses: tuple
    reason: str
    groups: tuple = ()
    scales: tuple | None = None


def plan_leaves(sites, count: int) -> tuple:
    """The `LeafPlan` of each of the `count` parameter leaves, from the loss's sites."""
    uses: list = [[] for _ in range(count)]
    for site in sites:
        for pos, view in site.views:
            uses[view.leaf].append(Use(site, pos, view))
    return tuple(_leaf_plan(u) for u in uses)


def _leaf_plan(uses) -> LeafPlan:
    if not uses:
        why = (
            "no gradient reaches it (not used, or only where none flows back, or on arrays "
            "with no entries): zero gradient"
        )
        return LeafPlan(Mode.UNUSED, (), why)
    others = [use.site for use in uses if use.site.kind is _sites.Kind.FALLBACK]
    if others:
        return LeafPlan(Mode.MATERIALISED, tuple(uses), others[0].reason)
    if forced() == "materialised":
        return LeafPlan(Mode.MATERIALISED, tuple(uses), "materialised: `force_ghost_route`")
    groups: dict = {}  # the uses of each part of the leaf (`slice`s, `split`s)
    for i, use in enumerate(uses):
        groups.setdefault(use.site.layout.pins, []).append(i)
    for a, b in itertools.combinations(groups, 2):
        if not _disjoint(a, b):
            why = "used through overlapping slices (no closed cross term)"
            return LeafPlan(Mode.MATERIALISED, tuple(uses), why)
    aligned = list(uses)
    for members in groups.values():
        first = uses[members[0]].site.layout
        for i in members:
            layout = uses[i].site.layout
            if layout[:3] == first.transposed()[:3] and layout[:3] != first[:3]:
                aligned[i] = uses[i]._replace(swapped=True)
            elif layout[:3] != first[:3]:
                why = "used by closed-form operations in different layouts (no closed cross term)"
                return LeafPlan(Mode.MATERIALISED, tuple(uses), why)
    keys = list(dict.fromkeys(use.view.scale_key for use in uses))
    scales = None if keys == [1.0] else tuple(use.view.scale for use in uses)
    why = _ghost_reason(uses, groups, keys)
    return LeafPlan(Mode.GHOST, tuple(aligned), why, tuple(map(tuple, groups.values())), scales)


def _disjoint(a, b) -> bool:
    """Whether the parts `a` and `b` of a leaf (``((dimension, (start, stop, stride)), ...)``)
    share no element: along some dimension both take, no index is in both."""
    taken = dict(b)
    return any(d in taken and not set(range(*part)) & set(range(*taken[d])) for d, part in a)


def _ghost_reason(uses, groups, keys) -> str:
    kinds = sorted({use.site.kind.value for use in uses})
    why = f"ghost: {len(uses)} use(s), " + ", ".join(kinds)
    if any(len(m) > 1 for m in groups.values()):
        why += " with cross terms"
    if len(groups) > 1:
        why += f", {len(groups)} disjoint parts"
    traced = any(isinstance(key, tuple) for key in keys)
    if len(keys) > 1:
        numbers = ", ".join(f"{k:g}" for k in keys) if not traced else ""
        why += ", each use scaled by its own number"
        why += ", some traced outside the loss" if traced else f" ({numbers})"
    elif traced:
        why += ", scaled by a number traced outside the loss"
    elif keys[0] != 1.0:
        why += f", scaled by {keys[0]:g}"
    return why


def route(plan: LeafPlan, shapes) -> Route | None:
    """The route of a leaf (None for an unused one), given the shapes ``(L, B, H, K, S)`` of
    each of its uses' factors ``[(x shape, y shape)]`` (for a ghost leaf): `forced`'s, else
    ``DIRECT`` for a single use of more than one row where ``K (C + F) > C F`` (its product
    ``(C, F)`` per example takes fewer multiply-adds than its Grams) and ``C F <= 2 K K``
    (the product is no larger than the two Grams: the factors are held either way, the
    product or the Grams beside them), else ``GRAMS``; a ``DIRECT`` convolution outside
    scans, its kernel's view not scaled, with ``C <= K`` (its product no larger than its output
    gradient), ``PRODUCT``."""
    if plan.mode is Mode.UNUSED:
        return None
    if plan.mode is Mode.MATERIALISED:
        return Route.MATERIALISED
    force = forced()
    product = len(shapes) == 1 and plan.uses[0].site.kind is not _sites.Kind.EMBED
    (_, _, _, k, c), (_, _, _, _, f) = shapes[0]
    if force in ("grams", "direct"):
        direct = force == "direct" and product
    else:
        direct = product and k > 1 and k * (c + f) > c * f and c * f <= 2 * k * k
    if not direct:
        return Route.GRAMS
    site = plan.uses[0].site
    alone = site.kind is _sites.Kind.CONV and not site.depth and not plan.scales
    return Route.PRODUCT if alone and not plan.uses[0].swapped and c <= k else Route.DIRECT


def ghost_sites(plans) -> dict:
    """``{site id: site}`` of the sites the tapped pass taps and records: the uses of the ghost
    leaves (each such site uses one leaf)."""
    return {use.site.id: use.site for plan in plans if plan.mode is Mode.GHOST for use in plan.uses}


def materialised(plans) -> list[int]:
    """The leaves whose per-example gradients the tapped pass forms."""
    return [i for i, plan in enumerate(plans) if plan.mode is Mode.MATERIALISED]
