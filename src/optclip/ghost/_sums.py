r"""The clipped sum by book-keeping: from the records and output gradients of the tapped pass,
with no second backward pass.

.. math:: \sum_b w_b\, g_b = \sum_{\text{sites}} \mathrm{VJP}_{\text{site}}\big(w \odot G\big)

For every site of a ghost leaf, the VJP of its equation over the whole batch (the recorded
operands batched, the parameter views not; over the layers of the scans it is inside) with
respect to the views, each example's terms weighted by its factor: the batch is contracted
inside the VJP, then carried back to the leaf through the view's chain. For a dense layer that
VJP is written out as one matrix product ``A^T (w G)`` over the batch's rows, as in ordinary
backpropagation (`_products.dense_view_sum`: JAX's own VJP transposes its product), and for a
convolution as JAX's transposed convolution for the kernel, laid out as XLA's CPU runtime
convolves fastest (`_products.conv_view_sum`). A dense layer or a
convolution is bilinear, so the factor goes on whichever of its input and output gradient is
smaller (``(w A)^T G``, no copy of the larger). The materialised leaves' sums are their
per-example gradients contracted with the factors (`_per_example._sums`).

The weighted side must stay in its dtype's normal range: inputs near float32's largest weighted
by a small factor flushed to zero (every term of that example lost), a side near float32's
largest weighted by ``1 / c`` (`rescale_to_unit_norm`) overflowed. Where some example's would
(`unsafe`, from the magnitudes the norms computed), the batch takes the second path below,
where each bilinear site's factor is shared between both sides (`balanced`), each brought near
the square root of their largest product.

A dropped example (padding, or a non-finite one with `nan_safe`) has factor 0, but ``0 * inf``
is NaN: when a dropped example's norm is not finite, the sums are taken one example after
another, each dropped example's records and output gradients zeroed first (a second path, taken
only then, whose copies are one example's). An example whose norm is finite has finite records
and output gradients at every ghost site: each of them enters its norm. Where every site reads
one row per example (`_leaves.reductions_only`: an MLP), the dropped examples are zeroed and
the factors shared in any case off a CPU, over the whole batch, with no `cond`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from optclip import _per_example
from optclip.ghost import _factors, _interpret, _leaves, _products


def _at(v, x, axis: int):
    """`v` (shape (B,)) shaped to broadcast along axis `axis` of `x`."""
    return v.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))


def _kept(x, keep, axis: int):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.where(_at(keep, x, axis), x, jnp.zeros((), x.dtype))


def _bilinear(site, record, cotangent) -> bool:
    """Whether `site`'s output is bilinear in its record and the parameter (a dense layer or a
    convolution): the factor may then go on either side of its product."""
    return site.kind in ("dense", "conv") and len(record) == 1 and len(cotangent) == 1


def _weights_record(site, record, cotangent) -> bool:
    """Whether the plain sum weights `site`'s record (the smaller side of a bilinear site)
    rather than its output gradients."""
    return _bilinear(site, record, cotangent) and record[0].size < cotangent[0].size


def _normal_exponents(dtype) -> tuple[int, int]:
    """``(lo, hi)``: a side of `dtype` weighted by ``w`` loses nothing that counts where the
    exponent ``a`` of ``w`` times its largest magnitude (so that ``2**(a-2) <= w max|x| <
    2**a``) is in ``[lo, hi]``, and none of its entries overflows. Below ``lo``, float32 and
    bfloat16 entries flush to zero on a CPU where they are more than ``2**-(nmant+2)`` of the
    largest; float16 ones (formed in float32, then rounded to float16's subnormal numbers, not
    flushed) are rounded more coarsely than float16 rounds the largest."""
    info = jnp.finfo(dtype)
    if info.minexp <= jnp.finfo(jnp.float32).minexp:
        return info.minexp + info.nmant + 4, info.maxexp - 1
    return info.minexp + 2, info.maxexp - 1


def unsafe(t, sides, w, kept):
    """Per example: True where the plain sums (one side of each bilinear site weighted by the
    example's factor `w`) would lose some of its terms, by the magnitudes `sides`
    (`_leaves.leaf_norm_terms`): the weighted side would leave its dtype's normal range
    (`_normal_exponents`). That takes a side past ``2**100`` times the other's over the clip
    norm (inputs near float32's largest, clipped to 1), or a factor above 1
    (`rescale_to_unit_norm`: ``1 / c``) times a side past ``c`` times float32's largest (an
    example whose gradient is 0 has factor ``1 / c``: ``inf * 0`` was NaN). Each layer of a
    scan counts (its side may be far smaller than another layer's). Only examples `kept` whose
    factor is neither 0 nor 1 count (either one multiplies exactly)."""
    _, ew = jnp.frexp(w)
    flags = jnp.zeros(w.shape, bool)
    for site in _leaves.ghost_sites(t.plans).values():
        record = _interpret.site_records(site, t.records)
        cotangent = t.grads[site.id]
        if not _bilinear(site, record, cotangent):
            continue  # (a lookup: the weighted side is the sum's own entries)
        side = 0 if _weights_record(site, record, cotangent) else 1
        e = sides[site.id][side]  # (L, B)
        lo, hi = _normal_exponents((record if side == 0 else cotangent)[0].dtype)
        zero = e == _factors.ZERO_EXPONENT
        largest = jnp.max(e, axis=0)
        smallest = jnp.min(jnp.where(zero, largest, e), axis=0)  # (of the layers not 0)
        out = (smallest + ew < lo) | (largest + ew > hi)
        flags |= out & ~jnp.all(zero, axis=0)
    return flags & kept & (w != 0) & (w != 1)


def balanced(w, e_record, e_grad, dtype):
    """Per example, the factors (each a pair of `dtype` numbers, applied one after the other)
    of a bilinear site's record and output gradient whose product is `w`, chosen so that both
    sides' largest magnitudes come out near each other, the square root of their largest
    product: neither side leaves the normal range while that product is in it, whatever the
    sides' magnitudes (`e_record`, `e_grad`: `_leaves._sides`, whose largest over the layers
    is taken). A side that is 0 is left as it is, and the other brought near 1 (a side near
    float32's largest, weighted by ``1 / c``, times zeros was NaN)."""
    info = jnp.finfo(dtype)
    e_record, e_grad = jnp.max(e_record, axis=0), jnp.max(e_grad, axis=0)
    mantissa, ew = jnp.frexp(w.astype(dtype))
    zero_r = e_record == _factors.ZERO_EXPONENT
    zero_g = e_grad == _factors.ZERO_EXPONENT
    shift = (e_grad - e_record - ew) // 2  # the output gradient's division, as a power of two
    shift = jnp.where(zero_g, -(e_record + ew), shift)
    shift = jnp.where(zero_r, 0, shift)
    low, high = 2 * (info.minexp + 1), 2 * (info.maxexp - 2)  # (two halves, each normal)
    up = jnp.clip(ew + shift, low, high)
    down = jnp.clip(-shift, low, high)
    (r1, r2), (g1, g2) = _factors.powers_of_two(up, dtype), _factors.powers_of_two(down, dtype)
    return (r1, r2 * mantissa), (g1, g2)


def _times(x, factors, axis: int):
    """`x` times each of `factors` (per example, along `axis`) in turn, rounded once to `x`'s
    dtype (float32 arithmetic for a float16 or bfloat16 `x`)."""
    wide = jnp.finfo(factors[0].dtype).bits > jnp.finfo(x.dtype).bits  # (named: strict promotion)
    work = factors[0].dtype if wide else x.dtype
    out = x.astype(work)
    for f in factors:
        out = out * _at(f, x, axis).astype(work)
    return out.astype(x.dtype)


def site_sum(site, leaves, records, grads, w, keep=None, spmd_axis_name=None, sides=None):
    """``{leaf index: sum_b w_b g_b}`` for the leaves `site` uses, from that equation alone;
    with `keep`, the other examples' records and output gradients are zeroed first; with
    `sides` (the site's, `_leaves._sides`), a bilinear site's factor is shared between both of
    its sides (`balanced`), else it goes on one."""
    depth = len(site.stack)
    values = [view.stacked(leaves[view.leaf]) for _, view in site.views]
    record = list(_interpret.site_records(site, records))
    cotangent = list(grads[site.id])
    if keep is not None:
        record = [_kept(x, keep, depth) for x in record]
        cotangent = [_kept(g, keep, depth) for g in cotangent]
    if sides is not None and _bilinear(site, record, cotangent):
        work = _per_example._work_dtype(record[0].dtype)
        e_record, e_grad = sides
        on_record, on_grad = balanced(w, e_record, e_grad, work)
        record[0] = _times(record[0], on_record, depth)
        cotangent[0] = _times(cotangent[0], on_grad, depth)
    elif _weights_record(site, record, cotangent):
        record[0] = _times(record[0], (w,), depth)
    else:
        cotangent = [_times(g, (w,), depth) for g in cotangent]
    if site.kind == "dense":
        (pos, _), (value,) = site.views[0], values
        product = _products.dense_view_sum(site.eqn, pos, value, record[0], cotangent[0], depth)
        return _leaves.pull_back(site, leaves, [product])

    def by_vjp():
        f = jax.vmap(
            _leaves.equation(site),
            in_axes=(0, *([None] * len(values))),
            axis_size=w.shape[0],  # (a site may record nothing)
            spmd_axis_name=spmd_axis_name,
        )
        for length in reversed(site.stack):  # the layers of the scans, outermost first
            f = jax.vmap(f, in_axes=(0, *([0] * len(values))), axis_size=length)
        _, pull = jax.vjp(lambda *views: f(record, *views), *values)
        return _leaves.pull_back(site, leaves, pull(cotangent))

    if site.kind != "conv":
        return by_vjp()

    def written():  # (on a CPU: `_products`)
        product = _products.conv_view_sum(site.eqn, values[0], record[0], cotangent[0], depth)
        return _leaves.pull_back(site, leaves, [product])

    return lax.platform_dependent(cpu=written, default=by_vjp)


def _ghost_sums(t, w, keep=None, spmd_axis_name=None, sides=None):
    """Every leaf's sum over its ghost sites, in leaf order, in float32 for a float16 or
    bfloat16 leaf (`rounded` once, at the end of `clipped_sums`). On a CPU the convolutions'
    sums are taken one after another (`_in_turn`)."""
    out = [jnp.zeros_like(leaf, _per_example._work_dtype(leaf.dtype)) for leaf in t.leaves]

    def added(site, total):
        mine = None if sides is None else sides[site.id]
        parts = site_sum(site, t.leaves, t.records, t.grads, w, keep, spmd_axis_name, mine)
        total = list(total)
        for leaf, g in parts.items():
            total[leaf] = total[leaf] + g.astype(total[leaf].dtype)
        return total

    sites = list(_leaves.ghost_sites(t.plans).values())
    convs = [site for site in sites if site.kind == "conv"]
    for site in sites:
        out = out if site.kind == "conv" and len(convs) > 1 else added(site, out)
    if len(convs) < 2:
        return out

    def together(total):
        for site in convs:
            total = added(site, total)
        return total

    return lax.platform_dependent(
        out, cpu=lambda total: _in_turn(convs, added, total), default=together
    )


def _in_turn(sites, added, total):
    """`total` with each of `sites`' sums added (`added(site, total)`), one site after another
    (`_leaves.in_turn_over`). XLA's CPU scheduler otherwise starts every convolution's layout
    copies (its record and output gradient transposed, `_products.conv_view_sum`) before the
    first convolution: on the benchmark's convnet, twelve copies of 16 MiB held at once at the
    peak, 2.14x the non-private step's memory at batch 64 and 16, against 1.38x and 1.55x so,
    in the same time. The dense sites are left outside the loop: with them in it, the MLP's
    step at 256 took 1.76x the non-private step's memory (1.14x without) and 1.21x its time
    (1.07x)."""
    return _leaves.in_turn_over(sites, added, total)


def _one_by_one(t, w, keep, sides):
    """Every leaf's sum (the ghost sites' and the materialised leaves') one example after
    another, each dropped example's records, output gradients and per-example gradients zeroed
    first (slices of one example: no copy of the batch's, which XLA would hold beside
    everything the sums read: the MLP at 256 took 1.20x the non-private step's memory with the
    materialised leaves' zeroed over the batch, 1.14x so); where the batch is split over a
    mesh (`Tapped.one_by_one`), the whole batch at once, zeroed. The examples' terms are added
    in float32 for a float16 or bfloat16 leaf (`rounded` once by `clipped_sums`). Each
    bilinear site's factor is shared between its sides (`balanced`)."""
    if not t.one_by_one:
        return with_materialised(t, w, keep, _ghost_sums(t, w, keep, None, sides), True)

    def step(total, b):
        cut = lambda v: lax.dynamic_slice_in_dim(v, b, 1)  # noqa: E731
        one, w_b, keep_b = t.example(b), cut(w), cut(keep)
        layers = lambda e: lax.dynamic_slice_in_dim(e, b, 1, axis=1)  # noqa: E731  (L, B)
        sums = _ghost_sums(one, w_b, keep_b, None, jax.tree.map(layers, sides))
        parts = with_materialised(one, w_b, keep_b, sums, True)
        return [a + p.astype(a.dtype) for a, p in zip(total, parts, strict=True)], None

    zeros = [jnp.zeros_like(leaf, _per_example._work_dtype(leaf.dtype)) for leaf in t.leaves]
    return lax.scan(step, zeros, jnp.arange(t.size))[0]


def rounded(t, sums: list) -> list:
    """`sums` (in leaf order, float32 for a float16 or bfloat16 leaf) in their leaves'
    dtypes."""
    return [s.astype(leaf.dtype) for s, leaf in zip(sums, t.leaves, strict=True)]


def with_materialised(t, w, keep, out: list, zeroed: bool) -> list:
    """`out` (every leaf's sum, in leaf order, in its work dtype) with the materialised leaves'
    weighted sums of their per-example gradients added (`_per_example._sums`; with `zeroed`,
    the examples not kept zeroed first, `_per_example._zeroed_sums`)."""
    wanted = sorted(t.example_grads)
    grads = [t.example_grads[k] for k in wanted]
    if zeroed:
        sums = _per_example._zeroed_sums(grads, lambda i: w, keep)
    else:
        sums = _per_example._sums(grads, lambda i: w, keep, "propagate")
    for k, g in zip(wanted, sums, strict=True):
        out[k] = out[k] + g.astype(out[k].dtype)
    return out


def clipped_sums(t, w, keep, finite, sides, spmd_axis_name=None):
    """Every leaf's ``sum_b w_b g_b`` (zeros for an unused leaf), in leaf order, from the
    tapped pass `t` (`_interpret.Tapped`): `w` are the factors, `keep` the examples kept,
    `finite` those of finite norm, `sides` the magnitudes of the ghost sites' records and
    output gradients (`_leaves.leaf_norm_terms`)."""

    def plain():  # every dropped example finite: its factor 0 zeroes its terms
        return with_materialised(t, w, keep, _ghost_sums(t, w, None, spmd_axis_name), False)

    def zeroed():
        return _one_by_one(t, w, keep, sides)

    # One `cond` for the ghost sites' sums and the materialised leaves' (they had one each: on
    # an H100 the two cost the MLP's step of 0.1 ms 0.4-0.6x, `private_parts.py --mlp`'s
    # ``sums without cond``). The plain sums need every dropped example finite (no dropped
    # example has a non-finite record) and every weighted side in its normal range (`unsafe`).
    clean = jnp.all(keep | finite) & ~jnp.any(unsafe(t, sides, w, keep & finite))
    branched = lambda: rounded(t, lax.cond(clean, plain, zeroed))  # noqa: E731
    if _leaves.reductions_only(t):
        # Every site reads one row per example (an MLP): off a CPU, the dropped examples are
        # zeroed in any case, at the price of a copy of those rows, rather than under a
        # `cond`, whose predicate XLA reads on the host on a GPU (`_leaves.reductions_only`). On a
        # CPU the `cond` is cheaper than the copies in float32 (`private_parts.py --mlp`: 1.17x
        # the non-private step against 1.23x at batch 256), not in float16 or bfloat16.
        def always():
            sums = _ghost_sums(t, w, keep, spmd_axis_name, sides)
            return rounded(t, with_materialised(t, w, keep, sums, True))

        if without_cond(t):
            return always()
        return lax.platform_dependent(cpu=branched, default=always)
    return branched()


def unused_as_weighted(t, sums: list, w, keep) -> list:
    """`sums` with each unused leaf's zeros NaN where a kept example's factor is not finite
    (``nan_safe=False`` and a non-finite example): ``sum_b w_b 0``, as the materialising way
    forms it, not 0 beside the other leaves' NaN."""
    unused = [i for i, plan in enumerate(t.plans) if plan.mode == "unused"]
    if not unused:
        return sums
    finite = jnp.all(jnp.isfinite(jnp.where(keep, w, 0)))
    out = list(sums)
    for i in unused:
        out[i] = jnp.where(finite, out[i], jnp.asarray(jnp.nan, out[i].dtype))
    return out


def without_cond(t) -> bool:
    """Whether the clipped sums zero the dropped examples in every step on a CPU as well (as
    off a CPU, `clipped_sums`): where every norm is a reduction (`_leaves.reductions_only`) and
    every record and output gradient of the ghost sites is narrower than the dtype it is
    contracted in (`_per_example._work_dtype`: float16, bfloat16). XLA on a CPU multiplies
    those in float32, and the `cond`'s plain branch held float32 copies of every
    product's operands at once: the benchmark's MLP in bfloat16 at 256 took 1.46x the
    non-private step's memory and 1.17x its time with the `cond`, 1.17x and 1.10x without
    (in float16 1.24x and 1.17x, 0.97x and 1.15x). The step then has no `cond`: its records
    are not pinned either (`_passes.row_major`)."""
    arrays = [*t.records.values(), *(g for gs in t.grads.values() for g in gs)]
    narrow = bool(arrays) and all(_narrower(a.dtype) for a in arrays)
    return narrow and _leaves.reductions_only(t)


def _narrower(dtype) -> bool:
    """Whether `dtype` is inexact and narrower than the dtype it is contracted in (an
    embedding's record, its ids, is not)."""
    return jnp.issubdtype(dtype, jnp.inexact) and _per_example._work_dtype(dtype) != dtype
