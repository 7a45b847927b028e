r"""Per-example squared norms of a parameter's gradient from its uses' factors, in closed form.

A dense or embedding use's per-example gradient (in the leaf's own dimensions, see
`_trace.Site.layout`) is, per head ``h``,

.. math:: g_{h} = \sum_k x_{hk} \otimes y_{hk}

with ``x`` built from the recorded operand (the layer's input; a one-hot row for a lookup) and
``y`` from the output gradient. For uses ``u, v`` of one leaf,
``<g^u, g^v> = sum_h sum_{k,l} (x^u_{hk} . x^v_{hl}) (y^u_{hk} . y^v_{hl})`` (the Gram route), or
for one use ``||sum_k x_k (outer) y_k||^2`` directly when that is fewer operations. Nothing of
the size batch x parameter is formed on the Gram route.

Every factor is first divided by a power of two near its largest magnitude (per example), so
that no product overflows or underflows; a term is carried as ``(exponent, value)``, its
squared norm being ``value * 4**exponent``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass
class Factor:
    """One side of a use's outer products, for every example: `values` of shape ``(B, H, K,
    S)``, or for a lookup's one-hot side `ids` of shape ``(B, H, K)`` into `size` rows."""

    values: Any = None
    ids: Any = None
    size: int = 0

    @property
    def shape(self):
        if self.values is not None:
            return self.values.shape
        return (*self.ids.shape, self.size)


# The exponent of a zero factor or norm: below every other (a zero must not set the scale that
# the other terms are expressed in), yet far from int32's limits when a few are added.
ZERO_EXPONENT = -(2**20)


def sum_of_squares(x, acc):
    """``(exponent, value)`` of each example's sum of squares of `x` (shape ``(B, ...)``),
    exact at every magnitude (no square overflows or flushes)."""
    scaled, exponent = normalised(x.reshape(x.shape[0], -1), acc)
    return exponent, jnp.sum(jnp.square(scaled), axis=1)


def normalised(x, acc):
    """`x` in `acc` divided by a power of two near each example's largest magnitude, and the
    exponents (int32, shape (B,)): ``x == result * 2**exponent``."""
    x = x.astype(acc)
    largest = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim)), initial=0)
    _, exponent = jnp.frexp(largest)
    exponent = jnp.where(jnp.isfinite(largest), exponent, 0)
    scale = jnp.ldexp(jnp.ones_like(largest), -exponent)
    exponent = jnp.where(largest == 0, ZERO_EXPONENT, exponent)  # (after the scale: 1 there)
    return x * scale.reshape((-1,) + (1,) * (x.ndim - 1)), exponent.astype(jnp.int32)


def dense_factors(record, grad, eqn, pos: int, acc, sliced=()):
    """The factors ``(x, y)`` and exponent of a `dot_general` whose operand `pos` is the view:
    `record` is the other operand, `grad` the output gradient, both with the batch axis and then
    one axis per enclosing scan; `sliced` says per scan whether the view is sliced along it
    (stacked layers: a head axis) or the same at every iteration (its uses are summed)."""
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    a_contract = tuple(contract_r if pos == 0 else contract_l)
    a_batch = tuple(batch_r if pos == 0 else batch_l)
    lead = 1 + len(sliced)  # the batch axis and the scans' axes
    a_free = tuple(d for d in range(record.ndim - lead) if d not in a_contract + a_batch)
    v_free = len(eqn.invars[pos].aval.shape) - len(a_contract) - len(a_batch)
    nb = len(a_batch)
    out_a = tuple(range(nb, nb + len(a_free)))
    out_v = tuple(range(nb + len(a_free), nb + len(a_free) + v_free))
    if pos == 0:
        out_v = tuple(range(nb, nb + v_free))
        out_a = tuple(range(nb + v_free, nb + v_free + len(a_free)))
    heads = tuple(1 + i for i, s in enumerate(sliced) if s)
    summed = tuple(1 + i for i, s in enumerate(sliced) if not s)

    def arrange(x, batch, free, rest):
        order = (0, *heads, *(lead + d for d in batch), *summed, *(lead + d for d in free))
        order = order + tuple(lead + d for d in rest)
        x = jnp.transpose(x, order)
        count_h = math.prod(x.shape[1 : 1 + len(heads) + len(batch)])
        count_k = math.prod(x.shape[1 + len(heads) + len(batch) : -len(rest) or None])
        return x.reshape(x.shape[0], count_h, count_k, -1)

    x, ex = normalised(arrange(record, a_batch, a_free, a_contract), acc)
    y, ey = normalised(arrange(grad, tuple(range(nb)), out_a, out_v), acc)
    return Factor(x), Factor(y), ex + ey


def conv_factors(record, grad, eqn, acc):
    """The factors of a convolution by the kernel: each output position's input patch (`x`,
    ``lax.conv_general_dilated_patches``) and output gradient (`y`)."""
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    kernel = eqn.invars[1].aval.shape
    window = tuple(kernel[d] for d in rhs_spec[2:])

    def patches(lhs):  # one example: (N, C * prod(window), *out spatial)
        return lax.conv_general_dilated_patches(
            jnp.transpose(lhs, lhs_spec),
            window,
            p["window_strides"],
            p["padding"],
            p["lhs_dilation"],
            p["rhs_dilation"],
            precision=HIGHEST,
        )

    x = jax.vmap(patches)(record.astype(acc))
    x = jnp.moveaxis(x, 2, -1)  # (B, N, *spatial, features)
    y = jnp.transpose(grad, (0, *(1 + d for d in out_spec)))
    y = jnp.moveaxis(y, 2, -1)  # (B, N, *spatial, out features)
    x = x.reshape(x.shape[0], 1, -1, x.shape[-1])
    y = y.reshape(y.shape[0], 1, -1, y.shape[-1])
    x, ex = normalised(x, acc)
    y, ey = normalised(y, acc)
    return Factor(x), Factor(y), ex + ey


def embed_factors(indices, grad, eqn, row: int, acc):
    """The factors of an embedding lookup: one-hot rows `indices[..., 0]` and the output
    gradient's rows (the lookup's mode decides what an index out of range does: clamped, or
    its row dropped)."""
    rows = eqn.invars[0].aval.shape[row]
    ids = indices[..., 0].reshape(indices.shape[0], 1, -1)
    y = grad.reshape(grad.shape[0], 1, ids.shape[2], -1)
    if "FILL" in str(eqn.params.get("mode", "")).upper():
        inside = (ids >= 0) & (ids < rows)
        y = jnp.where(inside[..., None], y, jnp.zeros((), y.dtype))
    ids = jnp.clip(ids, 0, rows - 1)
    y, ey = normalised(y, acc)
    return Factor(ids=ids, size=rows), Factor(y), ey


def gram(a: Factor, b: Factor, acc):
    """``(B, H, Ka, Kb)``: the inner products of every row of `a` with every row of `b`."""
    if a.values is not None and b.values is not None:
        return jnp.einsum("bhks,bhls->bhkl", a.values, b.values, precision=HIGHEST)
    if a.values is None and b.values is None:
        return (a.ids[..., :, None] == b.ids[..., None, :]).astype(acc)
    if a.values is None:
        return jnp.swapaxes(gram(b, a, acc), -1, -2)
    # a dense (B, H, Ka, S), b one-hot (B, H, Kb): a[b, h, k, ids[b, h, l]]
    ids = jnp.broadcast_to(b.ids[:, :, None, :], (*a.values.shape[:3], b.ids.shape[2]))
    return jnp.take_along_axis(a.values, ids, axis=3)


def pair_term(x1: Factor, y1: Factor, x2: Factor, y2: Factor, acc):
    """``<g1, g2>`` per example (scaled by the factors' exponents) by the Gram route."""
    return jnp.einsum("bhkl,bhkl->b", gram(x1, x2, acc), gram(y1, y2, acc), precision=HIGHEST)


def self_term(x: Factor, y: Factor, acc):
    """``||g||^2`` per example: directly (``sum_k x_k y_k^T``, then its squares) where that
    takes fewer operations than the Gram route, else by the Gram route."""
    if x.values is not None and y.values is not None:
        _, _, k, c = x.values.shape
        f = y.values.shape[3]
        if k * (c + f) > c * f:
            g = jnp.einsum("bhkc,bhkf->bhcf", x.values, y.values, precision=HIGHEST)
            return jnp.sum(jnp.square(g), axis=(1, 2, 3))
    return pair_term(x, y, x, y, acc)


def leaf_terms(uses, acc):
    """``(exponent, value)`` of one leaf's squared per-example norm from its uses' factors
    ``[(x, y, exponent)]`` (already aligned to one layout): the sum over every pair of uses."""
    exponents = [e for _, _, e in uses]
    top = exponents[0]
    for e in exponents[1:]:
        top = jnp.maximum(top, e)
    total: Any = 0
    for i, (xi, yi, ei) in enumerate(uses):
        for j in range(i, len(uses)):
            xj, yj, ej = uses[j]
            if i == j:
                term = self_term(xi, yi, acc)
            else:
                term = 2 * pair_term(xi, yi, xj, yj, acc)
            term = jnp.ldexp(term, ei + ej - 2 * top)
            total = total + term
    return top, jnp.maximum(total, 0)


def add_terms(terms):
    """The sum of squared norms given as ``(exponent, value)``, as ``(exponent, value)``."""
    top = terms[0][0]
    for e, _ in terms[1:]:
        top = jnp.maximum(top, e)
    return top, sum(jnp.ldexp(v, 2 * (e - top)) for e, v in terms)


def combine(terms):
    """The norms (shape (B,)) of sums of squared norms given as ``(exponent, value)``."""
    top, total = add_terms(terms)
    return jnp.ldexp(jnp.sqrt(total), top)
