r"""The clipped sum by book-keeping: from the records and output gradients of the tapped pass,
with no second backward pass.

.. math:: \sum_b w_b\, g_b = \sum_{\text{sites}} \mathrm{VJP}_{\text{site}}\big(w \odot G\big)

For every site of a ghost leaf, the VJP of its equation over the whole batch (the recorded
operands batched, the parameter views not; over the layers of the scans it is inside) with
respect to the views, each example's terms weighted by its factor: the batch is contracted
inside the VJP, then carried back to the leaf through the view's chain. Where its rule writes
that VJP out (`_rules.Rule.view_sum`: a dense layer's one matrix product ``A^T (w G)`` as
ordinary backpropagation's, a convolution's kernel gradient on a CPU) it is used. A dense
layer or a convolution is bilinear, so the factor may go on either side of its product
(``(w A)^T G``): on an input of the loss that one product alone reads, else on the smaller
side (`_weights_record`). The materialised leaves' sums are their per-example gradients
contracted with the factors.

The records and output gradients are normalized (`_interpret.scaled`): each example's
factor is multiplied by the powers of two they were divided by. Where a side is in a dtype
whose normal numbers stop short of float32's (float16), one power of two per site and layer
is taken out of the factors (`common_exponent`: the largest example's), so that the weighted
side's largest entry is near 1, not among the dtype's coarse subnormal numbers, and the
site's sum is multiplied by it after its product, in float32. A record
or output gradient that was not finite was zeroed: a dropped example (factor 0) contributes
exactly 0, a kept one (factor NaN) makes the sum NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from optclip.per_example import _clips
from optclip.per_example.ghost import (
    _factors,
    _interpret,
    _norms,
    _pieces,
    _plans,
    _products,
    _rules,
    _sites,
)
from optclip.per_example.ghost._target import Target

ZERO = _factors.ZERO_EXPONENT


def _bilinear(site, record, cotangent) -> bool:
    """Whether `site`'s output is bilinear in its record and the parameter (a dense layer or a
    convolution): the factor may then go on either side of its product."""
    closed = site.kind in (_sites.Kind.DENSE, _sites.Kind.CONV)
    return closed and len(record) == 1 and len(cotangent) == 1


def _weights_record(site, record, cotangent, input_: bool) -> bool:
    """Whether the plain sum weights `site`'s record rather than its output gradients, at a
    bilinear site: a record that is an input of the loss read by this site alone (`input_`),
    else the smaller side. The side not weighted is read normalized, a copy XLA may form as
    soon as its exponents are known and hold until the product; an input's weighted copy is
    formed for the product, and the caller holds the input itself."""
    if not _bilinear(site, record, cotangent):
        return False
    return input_ or record[0].size < cotangent[0].size


@jax.jit
def scaled(w, exponent, shift=0):
    """``w * 2**(exponent - shift)`` per example (and layer: `exponent` ``(*levels, B)``,
    `shift` ``(*levels)``), its power of two applied in two halves (a factor normal wherever
    the product is); ``w * 0`` (0, or NaN for a NaN `w`) where `exponent` marks a value not
    finite (`_interpret.FLAG`: its normalized values are zeros)."""
    flagged = exponent >= _interpret.FLAGGED
    k = jnp.where(flagged, 0, exponent - jnp.expand_dims(shift, -1))
    first, second = _factors.powers_of_two(k, w.dtype)
    return jnp.where(flagged, w * 0, (w * first) * second)


def common_exponent(w, exponents):
    """Per layer (``(*levels)``): the largest exponent of an example's weighted term,
    ``exponent(w_b) + e_b`` over the examples and over `exponents` (``(*levels, B)`` each: a
    record's and an output gradient's added), among the finite and nonzero ones (0 where
    there is none). A site's sum is taken with every example's factor divided by its power of
    two, its largest in [0.5, 1) (in a float16 or bfloat16 product too, where a weighted
    side below the dtype's normal numbers would round coarsely), and multiplied by it after."""
    ew = _factors.exponent(jnp.abs(lax.stop_gradient(w)))
    ew = jnp.where(ew > jnp.finfo(w.dtype).maxexp, ZERO, ew)
    top = jnp.full(exponents[0].shape[:-1], 2 * ZERO, jnp.int32)
    for e in exponents:
        valid = (e < _interpret.FLAGGED) & (e > ZERO // 2) & (ew > ZERO // 2)
        top = jnp.maximum(top, jnp.max(jnp.where(valid, e + ew, 2 * ZERO), axis=-1))
    return jnp.where(top == 2 * ZERO, 0, top)


def _narrow(dtype, wide) -> bool:
    """Whether floating `dtype`'s normal numbers stop short of `wide`'s (float16 beside
    float32): a weighted side in it is taken at the site's `common_exponent`. Elsewhere each
    example's powers of two are folded into its factor, which then underflows only where its
    contribution is below the sum's rounding."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).minexp > jnp.finfo(wide).minexp


def _times_power(x, k):
    """`x` (``(*levels, ...)``) times ``2**k`` (``(*levels)``), in its work dtype (float32 for
    a float16 or bfloat16 `x`)."""
    x = x.astype(_clips._work_dtype(x.dtype))
    first, second = _factors.powers_of_two(k.reshape(k.shape + (1,) * (x.ndim - k.ndim)), x.dtype)
    return (x * first) * second


@jax.jit
def _times(x, c):
    """`x` (laid out ``(*levels, B, ...)``) times `c` (``(*levels, B)``), rounded once to `x`'s
    dtype (float32 arithmetic for a float16 or bfloat16 `x`)."""
    wide = jnp.finfo(c.dtype).bits > jnp.finfo(x.dtype).bits  # (named: strict promotion)
    work = c.dtype if wide else x.dtype
    c = c.reshape(c.shape + (1,) * (x.ndim - c.ndim)).astype(work)
    return (x.astype(work) * c).astype(x.dtype)


def equation(site):
    """``f(record, *views)``: `site`'s equation for one example at one iteration of the scans
    it is inside, returning its floating-point outputs. An operand neither recorded nor a
    view (an added part's other operand: the part's gradient does not read it) is zeros."""
    positions = [pos for pos, _ in site.views]
    recorded = site.recorded
    outputs = _interpret.float_outputs(site.eqn)

    def f(record, *views):
        invals = [
            v.val if isinstance(v, jcore.Literal) else jnp.zeros(v.aval.shape, v.aval.dtype)
            for v in site.eqn.invars
        ]
        for i, x in zip(recorded, record, strict=True):
            invals[i] = x
        for i, x in zip(positions, views, strict=True):
            invals[i] = x
        outs = _interpret.bind(site.eqn, invals)
        return [outs[j] for j in outputs]

    return f


def _constants_merged(sliced, x):
    """`x`, laid out ``(*levels, B, ...)``, with the levels at which the view is the same at
    every step (not `sliced`: a weight applied at every step of its scan) merged into the
    examples: ``(*sliced levels, steps x B, ...)``. Every step's rows are then rows of one
    product over the batch, which XLA on a CPU runs faster than a product per step."""
    levels = len(sliced)
    keep = [i for i in range(levels) if sliced[i]]
    merged = [i for i in range(levels) if not sliced[i]] + [levels]
    order = [*keep, *merged, *range(levels + 1, x.ndim)]
    if order != list(range(x.ndim)):
        x = jnp.transpose(x, order)
    return x.reshape(*x.shape[: len(keep)], -1, *x.shape[levels + 1 :])


def pull_back(site, leaves, cotangents, views=None):
    """The cotangents of `site`'s views (or of `views`, in their order: the views with their
    constant levels dropped, `View.sliced_only`) carried back to their leaves (summed per leaf), in
    float32 for a float16 or bfloat16 leaf whose views keep its dtype (a scan's layers added
    there, not in float16); a view that converts the leaf's dtype takes its own. A scale
    traced outside the loss multiplies a nonzero entry only: a scale not finite gives every
    example a NaN norm, so that the batch is dropped or its weights are NaN."""
    out: dict = {}
    views = [view for _, view in site.views] if views is None else views
    for view, ct in zip(views, cotangents, strict=True):
        source = leaves[view.leaf].astype(_clips._work_dtype(leaves[view.leaf].dtype))
        scale = view.scale
        plain = view if isinstance(scale, float) else view.unscaled()
        viewed = jax.eval_shape(plain.stacked, source).dtype
        (g,) = jax.linear_transpose(plain.stacked, source)(ct.astype(viewed))
        if plain is not view:
            g = jnp.where(g == 0, jnp.zeros_like(g), g * scale.astype(g.dtype))
        out[view.leaf] = g if view.leaf not in out else out[view.leaf] + g
    return out


def site_sum(site, t: _interpret.Tapped, w, target: Target, axis=None):
    """``{leaf index: sum_b w_b g_b}`` for the leaves `site` uses, from that equation alone:
    each example's factor (times the powers of two its record and output gradient were divided
    by, `scaled`) on the side `_weights_record` picks at a bilinear site, else on the output
    gradients. An output gradient in pieces (`_pieces.Pieces`) is one product per piece where
    the site's rule writes its sum out, those blocks side by side; elsewhere the pieces are
    joined. `axis`: `jax.vmap`'s `spmd_axis_name`."""
    record, exponent = t.records[site.records[0]] if site.records else (None, 0)
    grads = list(t.grads[site.id])
    rule = _rules.RULES.get(site.eqn.primitive.name)
    written = rule is not None and rule.view_sum is not None
    if isinstance(grads[0], _pieces.Pieces):
        pieces = grads[0]
        arrays = ([] if record is None else [record]) + [g for g, _ in pieces.parts]
        if written and not any(_narrow(x.dtype, w.dtype) for x in arrays):
            blocks = []
            for part in pieces.parts:
                r, c, _, _ = _weighted(site, t, w, record, exponent, [part])
                blocks.append(_written(site, t, target, rule, r[0], c[0], narrow=False))
            if all(b is not None for b in blocks):
                _, views, depth = blocks[0]
                at = depth + _products.view_axis(site, pieces.axis)
                product = jnp.concatenate([b[0] for b in blocks], axis=at)
                return pull_back(site, t.leaves, [product], views)
        grads[0] = _pieces.joined(pieces, site.depth + 1)
    records, cotangent, narrow, shift = _weighted(site, t, w, record, exponent, grads)
    if written:
        found = _written(site, t, target, rule, records[0], cotangent[0], narrow)
        if found is not None:
            product, views, _ = found
            product = _times_power(product, shift) if narrow else product
            return pull_back(site, t.leaves, [product], views)
    values = [view.stacked(t.leaves[view.leaf]) for _, view in site.views]
    f = jax.vmap(
        equation(site),
        in_axes=(0, *([None] * len(values))),
        axis_size=w.shape[0],  # (a site may record nothing)
        spmd_axis_name=axis,
    )
    for length in reversed(site.stack):  # the layers of the scans, outermost first
        f = jax.vmap(f, in_axes=(0, *([0] * len(values))), axis_size=length)
    _, pull = jax.vjp(lambda *views: f(records, *views), *values)
    cotangents = pull(cotangent)
    if narrow:
        cotangents = [_times_power(ct, shift) for ct in cotangents]
    return pull_back(site, t.leaves, cotangents)


def _weighted(site, t: _interpret.Tapped, w, record, exponent, grads):
    """``(records, cotangents, narrow, shift)``: `site`'s record (a list of none or one) and
    output gradients `grads` (``[(array, exponent)]``), each example's factor on the side
    `_weights_record` picks, in a `_narrow` dtype at the site's `common_exponent` (`shift`:
    applied after the product)."""
    records = [] if record is None else [record]
    cotangent = [g for g, _ in grads]
    exponents = [exponent + e for _, e in grads]
    narrow = any(_narrow(x.dtype, w.dtype) for x in records + cotangent)
    shift = common_exponent(w, exponents) if narrow else jnp.zeros((), jnp.int32)
    factors = [scaled(w, e, shift) for e in exponents]
    input_ = bool(site.records) and site.records[0] in t.inputs
    if _weights_record(site, records, cotangent, input_):
        records[0] = _times(records[0], factors[0])
    else:
        cotangent = [_times(g, c) for g, c in zip(cotangent, factors, strict=True)]
    return records, cotangent, narrow, shift


def _written(site, t, target, rule, record, cotangent, narrow):
    """``(product, views, depth)``: the cotangent of `site`'s view as its rule writes it
    (`_rules.Rule.view_sum`) from the weighted `record` and `cotangent`, the levels at which
    the view is the same at every step merged into the examples (not where `narrow`: a shift
    per level is applied after); None where the rule gives none."""
    views, depth, r, c = [v for _, v in site.views], site.depth, record, cotangent
    sliced = _factors.sliced_levels(site)
    if not narrow and not all(sliced):
        views = [v.sliced_only() for v in views]
        r, c = _constants_merged(sliced, r), _constants_merged(sliced, c)
        depth = sum(sliced)
    value = views[0].stacked(t.leaves[views[0].leaf])  # (its shape, dtype and sharding)
    product = rule.view_sum(site, value, r, c, target, depth)
    return None if product is None else (product, views, depth)


def _ghost_sums(plans, t, w, target: Target, axis=None):
    """Every leaf's sum over its ghost sites, in leaf order, in float32 for a float16 or
    bfloat16 leaf. On a CPU the convolutions' sums are taken one after another (`in_turn`:
    XLA's CPU scheduler otherwise starts every convolution's layout copies before the
    first)."""
    out = [jnp.zeros_like(leaf, _clips._work_dtype(leaf.dtype)) for leaf in t.leaves]

    def added(site, total):
        total = list(total)
        for leaf, g in site_sum(site, t, w, target, axis).items():
            total[leaf] = total[leaf] + g.astype(total[leaf].dtype)
        return total

    for i, product in t.products.items():
        site = plans[i].uses[0].site
        for leaf, g in product_sum(site, t, scaled(w, product.exponent), product.values).items():
            out[leaf] = out[leaf] + g.astype(out[leaf].dtype)
    done = {plans[i].uses[0].site.id for i in t.products}
    sites = [s for s in _plans.ghost_sites(plans).values() if s.id not in done]
    convs = [s for s in sites if s.kind is _sites.Kind.CONV]
    convs = convs if len(convs) > 1 and target.cpu else []
    for site in sites:
        out = out if site in convs else added(site, out)
    return in_turn(convs, added, out) if convs else out


def product_sum(site, t: _interpret.Tapped, factors, product):
    """``{leaf: sum_b factors_b product_b}`` of a convolution's per-example gradients
    (`_norms.Product`, ``(B, H, S, F)``: its feature groups, its input features and window,
    its output features per group), carried to the kernel's layout and to its leaf."""
    p = site.eqn.params
    rhs_spec = p["dimension_numbers"].rhs_spec
    kernel = site.eqn.invars[1].aval.shape
    window = [kernel[d] for d in rhs_spec[2:]]
    total = jnp.einsum(
        "b,bhsf->hsf", factors.astype(product.dtype), product, precision=lax.Precision.HIGHEST
    )
    groups, _, per_group = total.shape
    total = total.reshape(groups, kernel[rhs_spec[1]], *window, per_group)
    total = jnp.moveaxis(total, -1, 1).reshape(kernel[rhs_spec[0]], kernel[rhs_spec[1]], *window)
    order = [rhs_spec.index(d) for d in range(len(kernel))]
    return pull_back(site, t.leaves, [jnp.transpose(total, order)])


def in_turn(items, step, carried):
    """`carried` after ``step(item, carried)`` for each of `items`, one after another: a loop
    over them (`lax.switch`), so that each item's temporaries live only in its own branch.
    XLA's CPU scheduler, which orders for concurrency, otherwise starts every item's work
    before the first item's (an `optimization_barrier` between them does not order them: the
    CPU pipeline drops it)."""
    branches = [lambda c, item=item: step(item, c) for item in items]
    return lax.fori_loop(0, len(branches), lambda i, c: lax.switch(i, branches, c), carried)


def clipped(plans, t: _interpret.Tapped, w, keep, target: Target, axis=None) -> list:
    """Every leaf's ``sum_b w_b g_b`` (see the module), in leaf order, in each leaf's work
    dtype: the ghost sites' book-kept; the materialised leaves' per-example gradients (as one
    array, `_norms.materialised`), the examples not `keep` zeroed (a dropped one may be NaN),
    contracted with the factors."""
    out = _ghost_sums(plans, t, w, target, axis)
    grads = _norms.materialised(plans, t)
    if grads is None:
        return out
    grads = jnp.where(keep[:, None], grads, jnp.zeros((), grads.dtype))
    total = _clips._weighted_sum(jnp.where(keep, w, 0), grads)
    wanted = _plans.materialised(plans)
    sizes = [t.leaves[k].size for k in wanted]
    for k, g in zip(wanted, jnp.split(total, np.cumsum(sizes)[:-1].tolist()), strict=True):
        out[k] = out[k] + g.reshape(t.leaves[k].shape).astype(out[k].dtype)
    return out


def finished(plans, t: _interpret.Tapped, sums: list, w, keep) -> list:
    """`sums` in their leaves' dtypes, each unused leaf's zeros NaN where a kept example's
    factor is not finite (``nan_safe=False`` and a non-finite example: ``sum_b w_b 0``, as the
    materialising way forms it, not 0 beside the other leaves' NaN)."""
    out = [s.astype(leaf.dtype) for s, leaf in zip(sums, t.leaves, strict=True)]
    unused = [i for i, plan in enumerate(plans) if plan.mode is _plans.Mode.UNUSED]
    if unused:
        finite = jnp.all(jnp.isfinite(jnp.where(keep, w, 0)))
        for i in unused:
            out[i] = jnp.where(finite, out[i], jnp.asarray(jnp.nan, out[i].dtype))
    return out
