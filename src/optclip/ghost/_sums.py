r"""The clipped sum by book-keeping: from the records and output gradients of the tapped pass,
with no second backward pass.

.. math:: \sum_b w_b\, g_b = \sum_{\text{sites}} \mathrm{VJP}_{\text{site}}\big(w \odot G\big)

For every site, the VJP of its equation over the whole batch (the recorded operands batched,
the parameter views not) with respect to the views, at each example's output gradient times
its factor: the batch is contracted inside the VJP (for a dense layer one matrix product
``A^T (w G)``, as in ordinary backpropagation), then carried back to the leaf through the
view's chain. A dropped example's records and output gradients are zeroed first (``0 * inf``
would be NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optclip.ghost import _interpret, _leaves


def _weighted(g, w, keep):
    """``w_b * g_b`` (rounded once to `g`'s dtype), zero for dropped examples."""
    shape = (-1,) + (1,) * (g.ndim - 1)
    work = jnp.float32 if jnp.finfo(g.dtype).bits < 32 else g.dtype
    scaled = (g.astype(work) * w.astype(work).reshape(shape)).astype(g.dtype)
    return jnp.where(keep.reshape(shape), scaled, jnp.zeros((), g.dtype))


def _kept(x, keep):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    return jnp.where(keep.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def site_sum(site, leaves, records, grads, w, keep, spmd_axis_name=None):
    """``{leaf index: sum_b w_b g_b}`` for the leaves `site` uses, from that equation alone."""
    values = [view.stacked(leaves[view.leaf]) for _, view in site.views]
    record = [_kept(x, keep) for x in _interpret.site_records(site, records)]
    cotangent = [_weighted(g, w, keep) for g in grads[site.id]]
    f = _leaves.equation(site)
    batched = jax.vmap(
        f,
        in_axes=(0, *([None] * len(values))),
        axis_size=w.shape[0],  # (a site may record nothing: a reduction of a parameter)
        spmd_axis_name=spmd_axis_name,
    )
    _, pull = jax.vjp(lambda *views: batched(record, *views), *values)
    return _leaves.pull_back(site, leaves, pull(cotangent))


def clipped_sums(leaf_plans, leaves, records, grads, w, keep, spmd_axis_name=None):
    """Every leaf's ``sum_b w_b g_b`` (zeros for an unused leaf), in leaf order."""
    sites = {}
    for plan in leaf_plans:
        for site, _, _ in plan.uses:
            sites[site.id] = site
    out = [jnp.zeros_like(leaf) for leaf in leaves]
    for site in sites.values():
        parts = site_sum(site, leaves, records, grads, w, keep, spmd_axis_name)
        for leaf, g in parts.items():
            out[leaf] = out[leaf] + g.astype(out[leaf].dtype)
    return out
