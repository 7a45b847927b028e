r"""A closed-form use's per-example gradient as factors, and the products its norm is made of.

A dense, convolution or embedding use's per-example gradient (in the leaf's dimensions, see
`_sites.Layout`) is, per head ``h``,

.. math:: g_{h} = \sum_k x_{hk} \otimes y_{hk}

with ``x`` built from the recorded operand (the layer's input, a convolution's patches, a
lookup's one-hot rows) and ``y`` from the output gradient. A factor's values have shape ``(L,
B, H, K, S)``: the layers of the scans that slice the weight, the examples, the operation's
own heads, the summed rows and the features, the order in which the tapped pass stacks records
and output gradients: a dense layer's factors are its record and output gradient reshaped. A
convolution's patches are held ``(L, B, H, S, K)`` (`Factor.rows_last`), as they are built.

For uses ``u, v`` of one leaf, ``<g^u, g^v> = sum_h sum_{k,l} (x^u_{hk} . x^v_{hl})
(y^u_{hk} . y^v_{hl})`` (`pair_term`, the Gram route), or for one use ``||sum_k x_k (outer)
y_k||^2`` directly (`self_term` with ``direct``), which `_plans.route` picks when it is fewer
operations. Terms come out per layer and example, shape ``(L, B)``.

Powers of two are built from their bits (`powers_of_two`, `exponent`): exact, a few integer
operations each, where ``jnp.ldexp`` and ``jnp.frexp`` are dozens of operations in the
program. They are jitted, as the engine's other per-tensor arithmetic is (`_interpret.scaled`,
`_sums.scaled`): each is traced and lowered once per shape and called at every layer. XLA
inlines the calls, so the compiled program is the one the operations written out would give.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optclip.per_example.ghost import _sites, _views

HIGHEST = lax.Precision.HIGHEST
_RANK = {None: 0, lax.Precision.DEFAULT: 0, lax.Precision.HIGH: 1, HIGHEST: 2}
# JAX's algorithm presets by the `lax.Precision` of their accuracy (on a GPU: DEFAULT and HIGH
# are TF32, HIGHEST float32; on a TPU: 1, 3 and 6 passes of bfloat16); others are HIGHEST.
_PRESETS = {
    "DEFAULT": None,
    "BF16_BF16_F32": lax.Precision.DEFAULT,
    "BF16_BF16_F32_X3": lax.Precision.HIGH,
    "TF32_TF32_F32": lax.Precision.HIGH,
}
# The exponent of a zero: below every other, yet far from int32's limits when a few are added.
ZERO_EXPONENT = -(2**20)


def product_precision(precision):
    """The `lax.Precision` (None: JAX's default) of a use's Grams, from the `precision` of the
    model's product they stand for: that precision, so that the norms are computed as the
    product is, and cost what it costs (at JAX's default on a GPU, TF32 where float32 would be
    several times slower). A pair (one per operand) gives the higher; an algorithm preset the
    `lax.Precision` of its accuracy; any other algorithm HIGHEST."""
    if precision is None or isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, tuple) and all(isinstance(p, lax.Precision) for p in precision):
        return higher(*precision)
    return _PRESETS.get(str(getattr(precision, "name", "")), HIGHEST)


def higher(*precisions):
    """The highest of `precisions` (`lax.Precision` or None, JAX's default)."""
    return max(precisions, key=lambda p: _RANK[p])


class Factor(NamedTuple):
    """One side of a use's outer products: `values` of shape ``(L, B, H, K, S)`` in the
    accumulation dtype (``(L, B, H, S, K)`` where `rows_last`: a convolution's patches, built
    with their positions last and read so by the products), or for a lookup's one-hot side
    `ids` of shape ``(L, B, H, K)`` into `size` rows; `precision` that of its Grams (a Gram of
    two factors takes the higher)."""

    values: Any = None
    ids: Any = None
    size: int = 0
    precision: Any = HIGHEST
    rows_last: bool = False

    @property
    def shape(self) -> tuple:
        """``(L, B, H, K, S)``; S is 1 for a one-hot side."""
        if self.values is None:
            return (*self.ids.shape, 1)
        shape = self.values.shape
        return (*shape[:3], shape[4], shape[3]) if self.rows_last else shape

    def rows_first(self):
        """`values` laid out ``(L, B, H, K, S)``."""
        return jnp.swapaxes(self.values, 3, 4) if self.rows_last else self.values

    def subscripts(self, rows: str, features: str) -> str:
        """The einsum subscripts of `values`, its rows and features named."""
        return "lbh" + (features + rows if self.rows_last else rows + features)


def _ints(dtype):
    return {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[jnp.finfo(dtype).bits]


@jax.jit
def exponent(m):
    """The int32 `e` with ``2**(e-1) <= m < 2**e`` of each magnitude `m` (>= 0, a float):
    read from its bits; `ZERO_EXPONENT` for 0 (and a subnormal, which XLA flushes); above
    every finite one's for inf and NaN."""
    info = jnp.finfo(m.dtype)
    bits = lax.bitcast_convert_type(m, _ints(m.dtype))
    field = (bits >> info.nmant) & ((1 << (info.bits - 1 - info.nmant)) - 1)
    field = field.astype(jnp.int32)
    return lax.select(field == 0, lax.full_like(field, ZERO_EXPONENT), field - (info.maxexp - 2))


@functools.partial(jax.jit, static_argnames=("dtype",))
def powers_of_two(k, dtype):
    """``2**k`` in the floating `dtype` as two factors, ``2**(k//2)`` and ``2**(k - k//2)``,
    to multiply by one after the other: each is exact (built from its bits) and normal, for
    any integer `k` within twice `dtype`'s normal exponents, where ``2**k`` itself may be
    subnormal (XLA on a CPU flushes it to zero) or overflow. Beyond that each half saturates
    at `dtype`'s smallest or largest normal power of two."""
    info = jnp.finfo(dtype)
    ints = _ints(dtype)
    k = jnp.asarray(k).astype(jnp.int32)
    low, high = info.minexp - 1, info.maxexp - 1

    def bits(h):
        h = lax.clamp(np.int32(low), h, np.int32(high)).astype(ints)
        return lax.bitcast_convert_type((h + ints(info.maxexp - 1)) << ints(info.nmant), dtype)

    half = k >> 1  # (floor division by 2, negative `k` included)
    return bits(half), bits(k - half)


@functools.partial(jax.jit, static_argnames=("dtype",))
def power_of_two(k, dtype):
    """``2**k`` in the floating `dtype`, built from its bits: exact for `k` within `dtype`'s
    normal exponents (the caller's to ensure)."""
    info = jnp.finfo(dtype)
    ints = _ints(dtype)
    k = jnp.asarray(k).astype(ints)
    return lax.bitcast_convert_type((k + ints(info.maxexp - 1)) << ints(info.nmant), dtype)


def brought_to(x, e, top):
    """`x` (laid out ``(*lead, ...)``), scaled by ``2**e`` per leading index, as scaled by
    ``2**top`` (``top >= e``, broadcast against `e`): times ``2**(e - top)``, exact, 0 where
    that is below twice the dtype's normal exponents. A zero's `e` (`ZERO_EXPONENT`) stays
    0; a `top` that is `ZERO_EXPONENT` leaves `x` as it is."""
    shift = jnp.where(top == ZERO_EXPONENT, 0, jnp.maximum(e - top, 2 * ZERO_EXPONENT))
    first, second = powers_of_two(shift, x.dtype)
    at = lambda h: h.reshape(h.shape + (1,) * (x.ndim - h.ndim))  # noqa: E731
    return (x * at(first)) * at(second)


def magnitude(f: Factor):
    """The largest magnitude of each layer of each example of `f` (shape ``(L, B)``; 1 for a
    one-hot side): one reduction of ``|x|``."""
    if f.values is None:
        return jnp.ones(f.ids.shape[:2], jnp.float32)
    x = f.values
    if not x.size:
        return jnp.zeros(x.shape[:2], x.dtype)
    return jnp.max(jnp.abs(x.reshape(*x.shape[:2], math.prod(x.shape[2:]))), axis=2)


def divided(f: Factor, e) -> Factor:
    """`f` divided by ``2**e`` per layer and example (``(L, B)``; a zero's `e`, and a one-hot
    side, left as they are): exact, two multiplies by normal powers of two."""
    if f.values is None:
        return f
    e = lax.select(e == ZERO_EXPONENT, lax.full_like(e, 0), e)
    e = e.reshape(e.shape + (1,) * (f.values.ndim - 2))
    first, second = powers_of_two(-e, f.values.dtype)
    return f._replace(values=(f.values * first) * second)


def squares(x, acc) -> Factor:
    """A per-example gradient `x` (shape ``(B, ...)``) as a factor of one layer, one head and
    one row, whose self term by the direct route is its sum of squares."""
    x = x.reshape(1, x.shape[0], 1, 1, math.prod(x.shape[1:]))
    if jnp.iscomplexobj(x):  # (|z|**2 = re**2 + im**2: both parts as features)
        x = jnp.concatenate([jnp.real(x), jnp.imag(x)], axis=4)
    return Factor(x.astype(acc))


def arrange(x, sliced, groups):
    """`x`, laid out ``(*levels, B, *operand dimensions)``, as ``(L, B, H, K, S)``: the levels
    `sliced` says are sliced (stacked layers) first, the examples, then `groups` = ``(heads,
    summed, features)`` of operand dimensions (the levels that are not sliced, a weight the same
    at every step of its scan, are summed too). Nothing moves when the groups come in order."""
    levels = len(sliced)
    heads, summed, features = groups
    at = lambda group: [levels + 1 + d for d in group]  # noqa: E731
    parts = (
        [i for i in range(levels) if sliced[i]],
        [levels],
        at(heads),
        [i for i in range(levels) if not sliced[i]] + at(summed),
        at(features),
    )
    order = [a for part in parts for a in part]
    if order != list(range(x.ndim)):
        x = jnp.transpose(x, order)
    sizes, start = [], 0
    for part in parts:
        sizes.append(math.prod(x.shape[start : start + len(part)]))
        start += len(part)
    return x.reshape(sizes)


def sliced_levels(site) -> tuple:
    """Per scan the site is inside, whether its view is sliced along it (stacked layers)
    rather than the same at every iteration (whose uses are summed)."""
    scans = (_views.SLICED, _views.CONSTANT)
    return tuple(entry == _views.SLICED for entry, _ in site.views[0][1].chain if entry in scans)


def dense_dims(eqn, pos: int):
    """For a `dot_general` whose operand `pos` is the view, in one example's dimensions: the
    other operand's head (batch), free and contracted dimensions (the contracted in the
    layer's pairing order), and the output's dimensions of the other operand's free ones and
    of the view's."""
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    a_contract = tuple(contract_r if pos == 0 else contract_l)
    a_batch = tuple(batch_r if pos == 0 else batch_l)
    a_ndim = len(eqn.invars[1 - pos].aval.shape)
    a_free = tuple(d for d in range(a_ndim) if d not in a_contract + a_batch)
    v_free = len(eqn.invars[pos].aval.shape) - len(a_contract) - len(a_batch)
    nb = len(a_batch)
    out_a = tuple(range(nb, nb + len(a_free)))
    out_v = tuple(range(nb + len(a_free), nb + len(a_free) + v_free))
    if pos == 0:  # the output's free dimensions: the view's first
        out_v = tuple(range(nb, nb + v_free))
        out_a = tuple(range(nb + v_free, nb + v_free + len(a_free)))
    return a_batch, a_free, a_contract, out_a, out_v


def dense_factors(site, record, grad, acc):
    """The factors ``(x, y)`` of a `dot_general` site: `record` is the other operand, `grad`
    the output gradient, both laid out ``(*levels, B, ...)`` (one level per enclosing scan)."""
    pos = site.views[0][0]
    a_batch, a_free, a_contract, out_a, out_v = dense_dims(site.eqn, pos)
    precision = product_precision(site.eqn.params["precision"])
    sliced = sliced_levels(site)
    x = arrange(record, sliced, (a_batch, a_free, a_contract))
    y = arrange(grad, sliced, (tuple(range(len(a_batch))), out_a, out_v))
    return Factor(x.astype(acc), precision=precision), Factor(y.astype(acc), precision=precision)


def embed_factors(site, indices, grad, acc):
    """The factors of an embedding lookup (outside scans): one-hot rows (the row index of each
    index vector) and the output gradient's rows, whose Grams are at HIGHEST precision (the
    lookup's gradient is a sum of those rows: no product's rounding to follow). An index out
    of range is clamped where the lookup's mode clips, else its row is dropped (as is a row
    whose column index is not 0, the only start of a whole row), as JAX's gradient of the
    lookup (a scatter) drops it."""
    eqn = site.eqn
    found = _sites.lookup(eqn, site.views[0][0])
    assert found is not None  # (an embed site is a lookup of rows)
    rows = eqn.invars[0].aval.shape[found.row]
    batch = indices.shape[0]
    ids = indices[..., found.row_index].reshape(1, batch, 1, -1)
    y = jnp.moveaxis(grad, 1 + found.features, -1).reshape(1, batch, 1, ids.shape[3], -1)
    if lax.GatherScatterMode.from_any(eqn.params.get("mode")) != lax.GatherScatterMode.CLIP:
        inside = (ids >= 0) & (ids < rows)
        if found.column_index is not None:
            inside &= indices[..., found.column_index].reshape(ids.shape) == 0
        y = jnp.where(inside[..., None], y, jnp.zeros((), y.dtype))
    return Factor(ids=jnp.clip(ids, 0, rows - 1), size=rows), Factor(y.astype(acc))


def added_factors(site, record, grad, acc):
    """The factors of a part added (`_sites.added`): a one of each example (`x`) and the
    output gradient (`y`, negated for a subtracted part), its features in the leaf's order,
    one row: the part's per-example gradient is the output gradient itself."""
    del record  # (none: `_sites.recorded`)
    pos, view = site.views[0]
    inner, placed = view.unit_dims_dropped()
    dims = inner.leaf_dims()[0]
    features = tuple(placed[d] for d in sorted(range(len(dims)), key=dims.__getitem__))
    units = tuple(d for d in range(grad.ndim - 1) if d not in features)
    y = arrange(grad, (), ((), units, features))
    if site.eqn.primitive.name == "sub" and pos == 1:
        y = -y
    x = jnp.ones((*y.shape[:4], 1), acc)
    return Factor(x), Factor(y.astype(acc))


def gram(a: Factor, b: Factor, acc):
    """``(L, B, H, Ka, Kb)``: the inner products of every row of `a` with every row of `b`."""
    if a.values is not None and b.values is not None:
        precision = higher(a.precision, b.precision)
        # (the layers and heads of size 1 left out of the product: XLA on a CPU lays out a
        # batched product's output with them in an order of its own, then copies it back)
        drop = tuple(d for d in (0, 2) if a.values.shape[d] == 1 == b.values.shape[d])
        x, y = jnp.squeeze(a.values, drop), jnp.squeeze(b.values, drop)
        n = 3 - len(drop)  # (the batch dimensions left: the examples, and layers or heads)
        features = [n if f.rows_last else n + 1 for f in (a, b)]
        batch = tuple(range(n))
        dims = (([features[0]], [features[1]]), (batch, batch))
        g = lax.dot_general(x, y, dims, precision=precision)
        return jnp.expand_dims(g, drop)
    if a.values is None and b.values is None:
        return (a.ids[..., :, None] == b.ids[..., None, :]).astype(acc)
    if a.values is None:
        return jnp.swapaxes(gram(b, a, acc), -1, -2)
    # a dense (L, B, H, Ka, S), b one-hot (L, B, H, Kb): a[..., k, ids[..., l]]
    ids = jnp.broadcast_to(b.ids[..., None, :], (*a.shape[:4], b.ids.shape[3]))
    return jnp.take_along_axis(a.rows_first(), ids, axis=4)


def pair_term(x1: Factor, y1: Factor, x2: Factor, y2: Factor, acc):
    """``<g1, g2>`` per layer and example, by the Gram route."""
    dense = all(f.values is not None for f in (x1, y1, x2, y2))
    if dense and x1.shape[3] == 1 and x2.shape[3] == 1:
        # one row each (a dense layer on one vector per example): the Grams are inner
        # products, whose reductions XLA fuses with anything that divides the factors
        p = jnp.sum(x1.rows_first() * x2.rows_first(), axis=4)
        q = jnp.sum(y1.rows_first() * y2.rows_first(), axis=4)
        return jnp.sum(p * q, axis=(2, 3))
    # (the barrier: XLA on the CPU otherwise fuses both Grams and their product into one loop,
    # slower than the three apart)
    p, q = lax.optimization_barrier((gram(x1, x2, acc), gram(y1, y2, acc)))
    return jnp.sum(p * q, axis=(2, 3, 4))


def self_term(x: Factor, y: Factor, acc, direct: bool):
    """``||g||^2`` per layer and example: with `direct`, as ``sum_k x_k y_k^T`` and then its
    squares; else by the Gram route."""
    if direct and x.values is not None and y.values is not None:
        precision = higher(x.precision, y.precision)
        spec = f"{x.subscripts('k', 'c')},{y.subscripts('k', 'f')}->lbhcf"
        g = jnp.einsum(spec, x.values, y.values, precision=precision)
        # (no `optimization_barrier` before the squares: with one, XLA 0.10.2 on a CPU computed
        # wrong sums of squares of one example's product, nondeterministically)
        return jnp.sum(jnp.square(g), axis=(2, 3, 4))
    return pair_term(x, y, x, y, acc)
