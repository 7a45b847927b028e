"""A convolution's factors (`_factors`): its input's patches, and its per-example kernel
gradient formed without them (the ``PRODUCT`` route, `_plans.Route`)."""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from optclip.per_example.ghost._factors import (
    Factor,
    arrange,
    product_precision,
    sliced_levels,
)


class Geometry(NamedTuple):
    """A convolution's input padded (and `lhs_dilation`-dilated) over its last ``len(window)``
    dimensions (`padded`), the output's spatial sizes (`out`), and each window offset's start
    in the padded input (`starts`, in row-major order of the offsets)."""

    padded: Any
    out: list
    starts: list


def geometry(x, window, strides, padding, lhs_dilation, rhs_dilation) -> Geometry:
    """`Geometry` of a convolution of `x` (its spatial dimensions last) by a `window`."""
    lead = x.ndim - len(window)
    spatial = ((lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation, strict=True))
    xp = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * lead + list(spatial))
    span = [(k - 1) * r + 1 for k, r in zip(window, rhs_dilation, strict=True)]
    out = [max((n - w) // s + 1, 0) for n, w, s in zip(xp.shape[lead:], span, strides)]
    offsets = itertools.product(*(range(k) for k in window))
    starts = [[o * r for o, r in zip(at, rhs_dilation, strict=True)] for at in offsets]
    return Geometry(xp, out, starts)


def patches(x, axis: int, window, strides, padding, lhs_dilation, rhs_dilation):
    """Each output position's input patch of a convolution, from `x` whose last ``len(window)``
    dimensions are the spatial ones: ``x.shape[:-nd]`` with the window's offsets inserted at
    `axis` (in row-major order), then the output's spatial dimensions: the entries of
    ``lax.conv_general_dilated_patches``. Slices of the padded (and `lhs_dilation`-dilated)
    input, one per offset: copies, where that function convolves with an identity kernel
    (the window's size in multiply-adds for every entry)."""
    g = geometry(x, window, strides, padding, lhs_dilation, rhs_dilation)
    lead = x.ndim - len(window)
    steps = (1,) * lead + tuple(strides)
    slices = []
    for start in g.starts:
        start = [a if n else 0 for a, n in zip(start, g.out, strict=True)]
        limit = [a + (n - 1) * s + 1 if n else 0 for a, n, s in zip(start, g.out, strides)]
        at, stop = (0,) * lead + tuple(start), (*g.padded.shape[:lead], *limit)
        slices.append(lax.slice(g.padded, at, stop, steps))
    return jnp.stack(slices, axis=axis)


def conv_factors(site, record, grad, acc):
    """The factors of a convolution by the kernel: each output position's input patch (`x`,
    `patches`: features ordered input feature first, then the window) and output gradient
    (`y`), a head per feature group (its input features' patches, its output features). The
    patches are built with their positions last (`Factor.rows_last`): each offset's slice is
    then a run of whole rows, and the Grams and products read them in that layout."""
    p = site.eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    kernel = site.eqn.invars[1].aval.shape
    window = tuple(kernel[d] for d in rhs_spec[2:])
    groups = p["feature_group_count"]
    sliced = sliced_levels(site)
    lead = len(sliced) + 1  # (the levels and the examples)
    # (*levels, B, C, N, *spatial): the input features before the images
    order = (lhs_spec[1], lhs_spec[0], *lhs_spec[2:])
    r = jnp.transpose(record.astype(acc), (*range(lead), *(lead + d for d in order)))
    x = patches(
        r, lead + 1, window, p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"]
    )  # (*levels, B, C, window, N, *out spatial)
    features = r.shape[lead] // groups * math.prod(window)
    x = x.reshape(*record.shape[:lead], groups, features, math.prod(x.shape[lead + 2 :]))
    y = jnp.transpose(grad, (*range(lead), *(lead + d for d in out_spec)))
    y = jnp.moveaxis(y, lead + 1, -1)  # (*levels, B, N, *spatial, out features)
    precision = product_precision(p["precision"])
    y = y.reshape(*grad.shape[:lead], -1, groups, y.shape[-1] // groups)
    if all(sliced):  # (heads, features, rows) as they are: ``(L, B, H, S, K)``
        x = x.reshape(math.prod(x.shape[: lead - 1]), *x.shape[lead - 1 :])
    else:  # (a level's rows joined to the positions: `arrange` moves them)
        x = jnp.swapaxes(arrange(jnp.swapaxes(x, -1, -2), sliced, ((0,), (1,), (2,))), 3, 4)
    y = arrange(y, sliced, ((1,), (0,), (2,))).astype(acc)
    return Factor(x, precision=precision, rows_last=True), Factor(y, precision=precision)


def conv_products(site, record, grad, acc):
    """A convolution's per-example kernel gradient outside scans, ``(B, H, S, F)``: its feature
    groups, its input features and window (in the patches' order: `conv_factors`) and its
    output features per group, from `record` and `grad` (``(B, ...)``). A loop over the
    window's offsets, each a product of a slice of the padded input with the output gradient
    contracting the positions: no patches are formed, and one slice is held at a time."""
    p = site.eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    kernel = site.eqn.invars[1].aval.shape
    window = [kernel[d] for d in rhs_spec[2:]]
    groups, strides = p["feature_group_count"], p["window_strides"]
    # (B, C, N, *spatial) and (B, O, N, *out spatial): features, images, positions
    order = lambda spec: (0, *(1 + d for d in (spec[1], spec[0], *spec[2:])))  # noqa: E731
    x, y = jnp.transpose(record, order(lhs_spec)), jnp.transpose(grad, order(out_spec))
    b, c, o = x.shape[0], x.shape[1] // groups, y.shape[1] // groups
    g = geometry(x.astype(acc), window, strides, p["padding"], p["lhs_dilation"], p["rhs_dilation"])
    x, out = g.padded, g.out
    y = jnp.swapaxes(y.astype(acc).reshape(b, groups, o, -1), 2, 3)  # (B, G, K, f)
    span = [(n - 1) * s + 1 for n, s in zip(out, strides)]
    starts = jnp.asarray(g.starts, jnp.int32).reshape(len(g.starts), len(window))
    precision = product_precision(p["precision"])

    def one(i, total):
        xs = lax.dynamic_slice(x, (0, 0, 0, *starts[i]), (*x.shape[:3], *span))
        xs = lax.slice(xs, (0,) * xs.ndim, xs.shape, (1, 1, 1, *strides))
        xs = xs.reshape(b, groups, c, -1)  # (B, G, c, K)
        product = jnp.einsum("bgck,bgkf->bgcf", xs, y, precision=precision)
        return lax.dynamic_update_index_in_dim(total, product, i, 3)

    w = len(g.starts)
    total = jnp.zeros((b, groups, c, w, o), acc)
    if all(out):
        total = lax.fori_loop(0, w, one, total)
    return total.reshape(b, groups, c * w, o)
