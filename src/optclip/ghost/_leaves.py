"""Each parameter leaf's per-example gradient norm: ghost where every use has a closed form, else
from its per-example gradient, materialised for that leaf only.

A leaf goes *ghost* when every use is a dense, embedding or convolution site and all of them
share one layout (or its transpose: the input and output embeddings of a tied model); its
squared norm is then the sum over every pair of uses (`_pairs.leaf_terms`, the cross terms
included, each use times the number its view scales the leaf by), from the records and output
gradients of its sites. Any other leaf is
*materialised*: the tapped pass gives each example its own copy of that leaf (the leaf plus a
per-example zero, `Deltas`), so that the backward pass yields each example's gradient of the
leaf, every use summed, and nothing of its sites is recorded; its squared norm is summed in
float32 after a power-of-two rescaling per example (`_factors.square_terms`: exact at every
magnitude, where `_per_example.example_norms` trusts a sum whose squares all flushed).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from optclip import _norm_rules, _per_example
from optclip.ghost import _factors, _interpret, _pairs, _trace


@dataclasses.dataclass
class LeafPlan:
    """How one leaf's norm is computed: `mode` is ``"ghost"``, ``"materialised"`` or
    ``"unused"``; `uses` are ``(site, operand position, View)``; `swapped` says, per use, that
    its factors are exchanged to match the first use's layout; `reason` says why."""

    mode: str
    uses: list
    swapped: list
    reason: str
    groups: list = dataclasses.field(default_factory=list)  # uses whose cross terms count
    scales: Any = None  # each use's view's number (`_views.View.scale`, a float or traced);
    # None where every use's is 1


def plan_leaves(sites, count: int):
    """The `LeafPlan` of each of the `count` parameter leaves."""
    uses: list = [[] for _ in range(count)]
    for site in sites:
        for pos, view in site.views:
            uses[view.leaf].append((site, pos, view))
    return [_leaf_plan(u) for u in uses]


def _leaf_plan(uses) -> LeafPlan:
    if not uses:
        why = (
            "no gradient reaches it (not used, or only where none flows back, or on arrays "
            "with no entries): zero gradient"
        )
        return LeafPlan("unused", [], [], why)
    others = [site for site, _, _ in uses if site.kind == "fallback"]
    if others:
        return LeafPlan("materialised", uses, [], others[0].reason)
    groups: dict = {}  # the uses of each set of single indices taken (`slice`s)
    for i, (site, _, _) in enumerate(uses):
        groups.setdefault(site.layout[3], []).append(i)
    for a, b in itertools.combinations(groups, 2):
        pins = dict(b)
        if not any(d in pins and pins[d] != i for d, i in a):
            why = "used through overlapping slices (no closed cross term)"
            return LeafPlan("materialised", uses, [], why)
    swapped = [False] * len(uses)
    for members in groups.values():
        first = uses[members[0]][0].layout
        for i in members:
            layout = uses[i][0].layout
            if layout[:3] == (first[0], first[2], first[1]) and layout[:3] != first[:3]:
                swapped[i] = True
            elif layout[:3] != first[:3]:
                why = "used by closed-form operations in different layouts (no closed cross term)"
                return LeafPlan("materialised", uses, [], why)
    kinds = sorted({site.kind for site, _, _ in uses})
    why = f"ghost: {len(uses)} use(s), " + ", ".join(kinds)
    if any(len(m) > 1 for m in groups.values()):
        why += " with cross terms"
    keys = list(dict.fromkeys(view.scale_key for _, _, view in uses))
    traced = any(isinstance(key, tuple) for key in keys)
    if len(keys) > 1:
        numbers = ", ".join(f"{k:g}" for k in keys) if not traced else ""
        why += ", each use scaled by its own number"
        why += ", some traced outside the loss" if traced else f" ({numbers})"
    elif traced:
        why += ", scaled by a number traced outside the loss"
    elif keys[0] != 1.0:
        why += f", scaled by {keys[0]:g}"
    scales = None if keys == [1.0] else [view.scale for _, _, view in uses]
    return LeafPlan("ghost", uses, swapped, why, list(groups.values()), scales)


def ghost_sites(leaf_plans) -> dict:
    """``{site id: site}`` of the sites the tapped pass taps and records: the uses of the ghost
    leaves (each such site uses one leaf)."""
    return {
        site.id: site for plan in leaf_plans if plan.mode == "ghost" for site, _, _ in plan.uses
    }


def materialised(leaf_plans) -> list[int]:
    """The leaves whose per-example gradients the tapped pass forms."""
    return [i for i, plan in enumerate(leaf_plans) if plan.mode == "materialised"]


def _factors_of(site, pos, records, grads, acc):
    """A dense, convolution or embed use's factors ``(x, y)``."""
    record = _interpret.site_records(site, records)[0]
    grad = grads[site.id][0]
    if site.kind in ("dense", "conv"):
        _, levels, _ = site.views[0][1].leaf_dims()
        sliced = tuple(level is not None for level in levels)
        if site.kind == "conv":
            return _factors.conv_factors(record, grad, site.eqn, acc, sliced)
        return _factors.dense_factors(record, grad, site.eqn, pos, acc, sliced)
    found = _trace.lookup(site.eqn, pos)
    assert found is not None  # (an embed site is a lookup of rows)
    return _factors.embed_factors(record, grad, site.eqn, found, acc)


def ghost_uses(leaf_plan, records, grads, acc):
    """A ghost leaf's uses' factors ``[(x, y)]``, aligned to the first use's layout."""
    uses = []
    for (site, pos, _), swap in zip(leaf_plan.uses, leaf_plan.swapped, strict=True):
        x, y = _factors_of(site, pos, records, grads, acc)
        uses.append((y, x) if swap else (x, y))
    return uses


def ghost_terms(leaf_plan, uses, acc, scaled: bool):
    """``(exponent, value)`` of a ghost leaf's squared per-example norms from its `uses`."""
    # Uses of different single indices of a dimension are orthogonal: no cross term.
    scales = leaf_plan.scales
    terms = [
        _factors.over_layers(
            _pairs.leaf_terms(
                [uses[i] for i in group], acc, scaled, scales and [scales[i] for i in group]
            )
        )
        for group in leaf_plan.groups
    ]
    return _factors.add_terms(terms)


def equation(site):
    """``f(record, *views)``: `site`'s equation for one example at one iteration of the scans
    it is inside, returning its floating-point outputs."""
    positions = [pos for pos, _ in site.views]
    recorded = _interpret.recorded_positions(site)
    outputs = _interpret.float_outputs(site.eqn)

    def f(record, *views):
        invals = [None] * len(site.eqn.invars)
        for i, x in zip(recorded, record, strict=True):
            invals[i] = x
        for i, x in zip(positions, views, strict=True):
            invals[i] = x
        outs = _interpret.bind(site.eqn, invals)
        return [outs[j] for j in outputs]

    return f


def pull_back(site, leaves, cotangents):
    """The views' cotangents of `site` carried back to their leaves (summed per leaf), in
    float32 for a float16 or bfloat16 leaf whose views keep its dtype (a scan's layers added
    there, not in float16: an example's sum below float16's normal numbers lost a unit of its
    last place at each); a view that converts the leaf's dtype takes its own."""
    out: dict = {}
    for (_, view), ct in zip(site.views, cotangents, strict=True):
        source = leaves[view.leaf].astype(_per_example._work_dtype(leaves[view.leaf].dtype))
        scale = view.scale
        plain = view if isinstance(scale, float) else view.unscaled()
        viewed = jax.eval_shape(plain.stacked, source).dtype
        (g,) = jax.linear_transpose(plain.stacked, source)(ct.astype(viewed))
        if plain is not view:
            g = _times_traced(g, scale)
        out[view.leaf] = g if view.leaf not in out else out[view.leaf] + g
    return out


def _times_traced(g, scale):
    """A leaf's sum `g` times its views' scale traced outside the loss, a zero entry kept zero:
    a scale not finite gives every example a NaN norm (`_pairs.parts`), so that the batch is
    dropped (its sums 0, as the materialising way's) or its weights are NaN (so are these)."""
    return jnp.where(g == 0, jnp.zeros_like(g), g * scale.astype(g.dtype))


def reductions_only(t) -> bool:
    """Whether every used leaf's squared norm is a reduction: a materialised leaf's (a sum of
    squares of its per-example gradient) or a ghost leaf's whose uses have one row per example
    (``K = 1``, as a dense layer applied to one vector per example: an MLP's; its Grams are
    products of two vectors' inner products). Then every norm is computed on factors divided
    by their magnitudes, which XLA fuses into the reductions (no copy of a factor), exact at
    every magnitude with no check and no `cond`. Where some leaf's Grams are products (a
    sequence's rows), the division would be a copy of every factor: every leaf is then
    checked (`_factors.safe`), under one `lax.cond` (`leaf_norm_terms`), as before."""
    rows = _use_rows(t)
    return all(plan.mode != "ghost" or max(rows[i]) == 1 for i, plan in enumerate(t.plans))


def _use_shapes(t) -> dict:
    """``{leaf: [(x shape, y shape)]}``: the factors' shapes ``(L, B, H, K, S)`` of every use
    of every ghost leaf (`jax.eval_shape`: nothing computed)."""
    shapes: dict = {}

    def count():
        for i, plan in enumerate(t.plans):
            if plan.mode == "ghost":
                uses = ghost_uses(plan, t.records, t.grads, jnp.float32)
                shapes[i] = [(x.shape, y.shape) for x, y in uses]
        return 0

    jax.eval_shape(count)
    return shapes


def _use_rows(t) -> dict:
    """``{leaf: [K of each use]}`` of the ghost leaves (a one-hot factor's rows too)."""
    return {i: [max(x[3], y[3]) for x, y in s] for i, s in _use_shapes(t).items()}


def _terms(t, scaled: bool, in_turn: bool = False):
    """Every leaf's ``(exponent, value)`` of its squared per-example norms (in leaf order)
    from the tapped pass `t`, whether computing them without dividing the factors by their
    magnitudes is exact (`_factors.safe` for every use of every example), and the magnitudes
    of the ghost sites' sides (`_sides`). Where every norm is a reduction (`reductions_only`),
    divided by their magnitudes in any case, and not checked. With `in_turn` (one example's
    terms, `_by_example`), the leaves with a convolution use are taken one after another
    (`in_turn_over`): XLA's CPU scheduler otherwise forms every convolution's patches at once
    (the benchmark's convnet at batch 16: 1.32x the non-private step's memory, 1.19x so)."""
    acc = _norm_rules.widest_accum_dtype([x.dtype for x in t.leaves] or [jnp.float32])
    exact = reductions_only(t)
    scaled = scaled or exact

    def leaf(i):  # (checks, terms, sides) of leaf i
        plan = t.plans[i]
        if plan.mode == "ghost":
            uses = ghost_uses(plan, t.records, t.grads, acc)
            checks = [] if exact else [jnp.all(_factors.safe(x, y)) for x, y in uses]
            return checks, ghost_terms(plan, uses, acc, scaled), _sides(plan, uses)
        if plan.mode == "materialised":
            f = _factors.squares(t.example_grads[i], acc)
            checks = [] if exact else [jnp.all(_factors.safe_squares(f))]
            return checks, _factors.square_terms(f, scaled), {}
        zero = jnp.zeros_like(t.losses, acc)  # (split over a mesh like the batch)
        return [], (zero.astype(jnp.int32), zero), {}  # (a zero sets no scale: `add_terms`)

    convs = [i for i, plan in enumerate(t.plans) if in_turn and _convolved(plan)]
    convs = convs if len(convs) > 1 else []
    results = {i: leaf(i) for i in range(len(t.plans)) if i not in convs}
    if convs:
        shapes = jax.eval_shape(lambda: [leaf(i) for i in convs])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def done(k, results):  # the k-th convolved leaf's results in its place
            return [leaf(convs[k]) if j == k else r for j, r in enumerate(results)]

        results.update(zip(convs, in_turn_over(range(len(convs)), done, zeros), strict=True))
    checks, terms, sides = [], [], {}
    for i in range(len(t.plans)):
        checks += results[i][0]
        terms.append(results[i][1])
        sides.update(results[i][2])
    return terms, (jnp.all(jnp.stack(checks)) if checks else True), sides


def _convolved(plan) -> bool:
    """Whether a leaf is ghost with a convolution use (its input factor: patches)."""
    return plan.mode == "ghost" and any(site.kind == "conv" for site, _, _ in plan.uses)


def in_turn_over(items, step, carried):
    """`carried` after ``step(item, carried)`` for each of `items`, one after another: a loop
    over them (`lax.switch`), so that each item's temporaries live only in its own branch.
    XLA's CPU scheduler, which orders for concurrency, otherwise starts every item's work (the
    convolutions' patches, their layout copies) before the first item's. (An
    `optimization_barrier` between them does not order them: the CPU pipeline drops it.)"""
    branches = [lambda c, item=item: step(item, c) for item in items]
    return lax.fori_loop(0, len(branches), lambda i, c: lax.switch(i, branches, c), carried)


def _sides(leaf_plan, uses) -> dict:
    """``{site id: (record's, output gradient's)}`` for each use of a ghost leaf: per layer of
    its scans and example (shape ``(L, B)``), the exponent of each side's largest magnitude
    (`_factors.magnitude`; `_factors.ZERO_EXPONENT` where the side is 0), as the norms
    computed it. The clipped sums read them (`_sums.unsafe`, `_sums.balanced`)."""
    out = {}
    for (site, _, _), swap, (x, y) in zip(leaf_plan.uses, leaf_plan.swapped, uses, strict=True):
        record, grad = (y, x) if swap else (x, y)
        out[site.id] = (record.exponent, grad.exponent)
    return out


def leaf_norm_terms(t):
    """``(exponent, value)`` of every leaf's squared per-example norms, in leaf order, from the
    tapped pass `t` (`_interpret.Tapped`); and the magnitudes of the ghost sites' records and
    output gradients (`_sides`), for the clipped sums.

    Where every norm is a reduction (`reductions_only`: an MLP), computed on factors divided
    by their magnitudes, exact at every magnitude with no check and no `cond` (on a GPU, XLA
    reads a `cond`'s predicate on the host: a wait, in a step of a tenth of a millisecond).
    Otherwise computed on the factors as they are where every use of every example is safe
    (the common case: no pass that divides the records and output gradients by their
    magnitudes; on a CPU one example at a time where the Grams are large, `_unscaled`), else
    (one `lax.cond` for the batch) one example after another, each factor divided by its
    magnitude: exact at every magnitude, the same values where both are (to the order XLA sums
    in), and no more memory than the first way (`_scaled`)."""
    terms, safe, sides = _unscaled(t)
    if safe is True:  # (nothing checked: every norm a reduction, `_terms`)
        return terms, sides
    return lax.cond(safe, lambda: terms, lambda: _scaled(t)), sides


# The per-example multiply-adds of the Grams above which the loop pays for its iterations.
LOOP_WORK = 2**23


def _gram_work(t) -> int:
    """The multiply-adds of one example's Grams (every ghost use's own, ``L H K^2 (Sx +
    Sy)``), from the shapes of its factors."""
    return sum(
        x[0] * x[2] * x[3] * x[3] * (x[4] + y[4])
        for uses in _use_shapes(t).values()
        for x, y in uses
    )


def _unscaled(t):
    """`_terms` on the factors as they are (with whether that is exact, and the sides): on a CPU
    one example after another (`lax.map`; where `Tapped.one_by_one`), elsewhere the whole batch
    at once. XLA on the CPU runs a batch of per-example Grams as one product 1.6x slower than as
    a loop of one example's products, each checked and reduced while its factors are in the
    cache (`benchmarks/private_parts.py --grams`); a GPU would serialise the loop. Never where
    every norm is a reduction (`reductions_only`: no Gram has rows to keep in the cache)."""
    if not t.one_by_one or _gram_work(t) < LOOP_WORK or reductions_only(t):
        return _terms(t, scaled=False)
    return lax.platform_dependent(
        cpu=lambda: _by_example(t, scaled=False), default=lambda: _terms(t, scaled=False)
    )


def _by_example(t, scaled: bool):
    """`_terms` one example after another (`lax.map`; slices of one example, see
    `Tapped.one_by_one`), each example's convolved leaves in turn: on a CPU for the unscaled
    norms (`_unscaled`), on every platform for the scaled ones (`_scaled`)."""

    def one(b):
        terms, safe, sides = _terms(t.example(b), scaled=scaled, in_turn=True)
        sides = {k: (r[:, 0], g[:, 0]) for k, (r, g) in sides.items()}
        return [(e[0], v[0]) for e, v in terms], safe, sides

    terms, safe, sides = lax.map(one, jnp.arange(t.size))
    return terms, jnp.all(safe), {k: (r.T, g.T) for k, (r, g) in sides.items()}


def _scaled(t):
    """Every leaf's terms with each factor divided by its magnitude, one example after another
    (or the whole batch at once where the batch is split over a mesh: `Tapped.one_by_one`)."""
    if not t.one_by_one:
        return _terms(t, scaled=True)[0]
    return _by_example(t, scaled=True)[0]
