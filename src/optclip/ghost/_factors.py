r"""Per-example squared norms of a parameter's gradient from its uses' factors, in closed form.

A dense or embedding use's per-example gradient (in the leaf's own dimensions, see
`_trace.Site.layout`) is, per head ``h``,

.. math:: g_{h} = \sum_k x_{hk} \otimes y_{hk}

with ``x`` built from the recorded operand (the layer's input; a one-hot row for a lookup) and
``y`` from the output gradient. For uses ``u, v`` of one leaf,
``<g^u, g^v> = sum_h sum_{k,l} (x^u_{hk} . x^v_{hl}) (y^u_{hk} . y^v_{hl})`` (the Gram route), or
for one use ``||sum_k x_k (outer) y_k||^2`` directly when that is fewer operations. Nothing of
the size batch x parameter is formed on the Gram route.

A factor's values have shape ``(L, B, H, K, S)``: the layers of the scans the use is inside (the
stacked layers, each a head of its own), the examples, the heads of the operation itself (a
`dot_general` batch dimension), the summed rows and the features. That is the order in which the
tapped pass stacks records and output gradients, so that in the common case (a dense layer in
or outside a scan) the factors are the records and output gradients themselves, reshaped, with
nothing moved. Terms come out per layer and example, shape ``(L, B)``, and `over_layers` adds
the layers up.

Every factor is divided by a power of two near its largest magnitude (per layer and example), so
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
_RANK = {None: 0, lax.Precision.DEFAULT: 0, lax.Precision.HIGH: 1, HIGHEST: 2}
# JAX's algorithm presets by the `lax.Precision` of their accuracy (on a GPU: DEFAULT and HIGH
# are TF32, HIGHEST float32; on a TPU: 1, 3 and 6 passes of bfloat16); others are HIGHEST.
_PRESETS = {
    "DEFAULT": None,
    "BF16_BF16_F32": lax.Precision.DEFAULT,
    "BF16_BF16_F32_X3": lax.Precision.HIGH,
    "TF32_TF32_F32": lax.Precision.HIGH,
}


def product_precision(precision):
    """The `lax.Precision` (None: JAX's default) of a use's Grams, from the `precision` of the
    model's product they stand for (a `dot_general`'s or a convolution's): that precision, so
    that the norms are computed as the product is, and cost what it costs (at JAX's default on
    a GPU, TF32 where float32 would be several times slower). A pair (one per operand) gives
    the higher; an algorithm preset the `lax.Precision` of its accuracy; any other algorithm
    HIGHEST."""
    if precision is None or isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, tuple) and all(isinstance(p, lax.Precision) for p in precision):
        return higher(*precision)
    return _PRESETS.get(str(getattr(precision, "name", "")), HIGHEST)


def higher(*precisions):
    """The highest of `precisions` (`lax.Precision` or None, JAX's default)."""
    return max(precisions, key=lambda p: _RANK[p])


@dataclasses.dataclass
class Factor:
    """One side of a use's outer products: `values` of shape ``(L, B, H, K, S)``, or for a
    lookup's one-hot side `ids` of shape ``(L, B, H, K)`` into `size` rows; `exponent` (int32,
    ``(L, B)``) is that of a power of two near the largest magnitude of each layer of each
    example (`magnitude`; 0 for a one-hot side, which is never scaled); `precision` that of
    its Grams (`product_precision`: a Gram of two factors takes the higher)."""

    values: Any = None
    ids: Any = None
    size: int = 0
    exponent: Any = None
    precision: Any = HIGHEST

    @property
    def shape(self) -> tuple:
        """``(L, B, H, K, S)``; S is 1 for a one-hot side (its Gram is exact)."""
        return self.values.shape if self.values is not None else (*self.ids.shape, 1)

    def scaled(self) -> Factor:
        """The factor divided by ``2**exponent`` (its largest magnitude in [0.5, 1)), as two
        halves: ``2**-exponent`` itself is subnormal for a factor past ``2**126``, and XLA on
        a CPU flushes it to zero."""
        if self.values is None:
            return self
        e = jnp.where(self.exponent == ZERO_EXPONENT, 0, self.exponent)  # (a zero stays 0)
        e = e.reshape(e.shape + (1,) * (self.values.ndim - 2))
        first, second = powers_of_two(-e, self.values.dtype)
        values = (self.values * first) * second
        return dataclasses.replace(self, values=values)


# The exponent of a zero factor or norm: below every other (a zero must not set the scale that
# the other terms are expressed in), yet far from int32's limits when a few are added.
ZERO_EXPONENT = -(2**20)


def powers_of_two(k, dtype):
    """``2**k`` in the floating `dtype` as two factors, ``2**(k//2)`` and ``2**(k - k//2)``, to
    multiply by one after the other: each is exact (built from its bits) and normal for any
    integer ``k`` within twice `dtype`'s normal exponents, where ``2**k`` itself may be
    subnormal (XLA on a CPU flushes it to zero) or overflow."""
    info = jnp.finfo(dtype)
    ints = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[info.bits]
    k = jnp.asarray(k).astype(ints)
    bits = lambda n: lax.bitcast_convert_type((n + (info.maxexp - 1)) << info.nmant, dtype)  # noqa: E731
    return bits(k // 2), bits(k - k // 2)


def squares(x, acc) -> Factor:
    """A per-example gradient `x` (shape ``(B, ...)``) as a factor whose `square_terms` are
    its squared norms."""
    return factor(x.reshape(1, x.shape[0], 1, 1, math.prod(x.shape[1:])), acc)


def square_terms(f: Factor, scaled: bool = True):
    """``(exponent, value)`` of each example's sum of squares of `f` (`squares`): divided by
    its magnitude first with `scaled` (exact at every magnitude), else as it is (exponent 0;
    the same values where `safe_squares`: a power of two divides exactly)."""
    if scaled:
        f = f.scaled()
    exponent = f.exponent[0] if scaled else jnp.zeros_like(f.exponent[0])
    return exponent, jnp.sum(jnp.square(f.values), axis=(2, 3, 4))[0]


def safe_squares(f: Factor):
    """Per example: True where `square_terms` needs no division by the magnitude, by the bound
    ``|x| < 2**e``: the sum of squares stays below ``2**100`` (`safe`'s room), and the squares
    that flush (below ``2**-126``) add up to less than ``2**-26`` of the largest square's scale
    ``2**(2e-2)``."""
    size = f.values.shape[4]
    e = f.exponent[0].astype(jnp.float32)  # (exact; beside Python floats under strict promotion)
    fits = (2 * e + math.log2(size) <= 100) & (2 * e >= math.log2(size + 1) - 98)
    return fits | (e == ZERO_EXPONENT)


def factor(x, acc, precision=HIGHEST) -> Factor:
    """`x` (shape ``(L, B, H, K, S)``) in `acc`, as a `Factor` with its `magnitude`, its Grams
    at `precision`."""
    x = x.astype(acc)
    return Factor(x, exponent=magnitude(x), precision=precision)


def magnitude(x):
    """The exponent (int32, shape ``(L, B)``) of a power of two near the largest magnitude of
    each layer of each example of `x` (``(L, B, ...)``): ``2**(e-1) <= max|x| < 2**e``; 0 where
    that is not finite (nothing to scale), `ZERO_EXPONENT` where it is 0."""
    flat = x.reshape(*x.shape[:2], math.prod(x.shape[2:]))
    largest = lax.platform_dependent(flat, cpu=_largest_apart, default=_largest_at_once)
    _, exponent = jnp.frexp(largest)
    exponent = jnp.where(jnp.isfinite(largest), exponent, 0)
    return jnp.where(largest == 0, ZERO_EXPONENT, exponent).astype(jnp.int32)


def _largest_apart(flat):
    """``max |x|`` over the last axis (0 for none) from the largest and the smallest entry,
    two reductions: XLA on the CPU runs each 5x faster than one reduction of ``|x|``."""
    return jnp.maximum(jnp.max(flat, axis=2, initial=0), -jnp.min(flat, axis=2, initial=0))


def _largest_at_once(flat):
    """``max |x|`` over the last axis (0 for none), one reduction: one read of the factor on a
    GPU (the two reductions of `_largest_apart` took 0.07x of the non-private step in the
    transformer's ghost step at 256 on an H100: `benchmarks/private_parts.py`'s ``check
    without cond`` against ``batched, unchecked``)."""
    return jnp.max(jnp.abs(flat), axis=2, initial=0)


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


def dense_factors(record, grad, eqn, pos: int, acc, sliced=()):
    """The factors ``(x, y)`` of a `dot_general` whose operand `pos` is the view:
    `record` is the other operand, `grad` the output gradient, both laid out ``(*levels, B,
    ...)`` (one level per enclosing scan); `sliced` says per level whether the view is sliced
    along it (stacked layers) or the same at every iteration (its uses are summed)."""
    a_batch, a_free, a_contract, out_a, out_v = dense_dims(eqn, pos)
    precision = product_precision(eqn.params["precision"])
    x = factor(arrange(record, sliced, (a_batch, a_free, a_contract)), acc, precision)
    y = arrange(grad, sliced, (tuple(range(len(a_batch))), out_a, out_v))
    return x, factor(y, acc, precision)


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


def conv_factors(record, grad, eqn, acc, sliced=()):
    """The factors of a convolution by the kernel: each output position's input patch (`x`,
    ``lax.conv_general_dilated_patches``: features ordered input feature first, then the
    window) and output gradient (`y`), a head per feature group (its input features' patches,
    its output features). `record` and `grad` are laid out ``(*levels, B, ...)`` (one level per
    enclosing scan), `sliced` as for `dense_factors`."""
    p = eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    kernel = eqn.invars[1].aval.shape
    window = tuple(kernel[d] for d in rhs_spec[2:])
    groups = p["feature_group_count"]
    lead = len(sliced) + 1  # (the levels and the examples)

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

    x = jax.vmap(patches)(record.astype(acc).reshape(-1, *record.shape[lead:]))
    x = jnp.moveaxis(x, 2, -1)  # (levels x B, N, *spatial, features)
    y = jnp.transpose(grad, (*range(lead), *(lead + d for d in out_spec)))
    y = jnp.moveaxis(y, lead + 1, -1)  # (*levels, B, N, *spatial, out features)
    precision = product_precision(p["precision"])
    at = ((1,), (0,), (2,))  # (rows, heads, features: the heads are the groups)
    x = x.reshape(*record.shape[:lead], -1, groups, x.shape[-1] // groups)
    y = y.reshape(*grad.shape[:lead], -1, groups, y.shape[-1] // groups)
    x = factor(arrange(x, sliced, at), acc, precision)
    return x, factor(arrange(y, sliced, at), acc, precision)


def embed_factors(indices, grad, eqn, found, acc):
    """The factors of an embedding lookup (outside scans), `found` its `_trace.Lookup`: one-hot
    rows (the row index of each index vector) and the output gradient's rows, whose Grams are
    at HIGHEST precision (the lookup's gradient is a sum of those rows: no product's rounding
    to follow). An index out of range is clamped where the lookup's mode clips, else its row
    is dropped (as is a row whose column index is not 0, the only start of a whole row), as
    JAX's gradient of the lookup drops it: ``table[ids]``'s promise that ids are in range
    reads the nearest row, but its gradient (a scatter) drops an index out of range."""
    rows = eqn.invars[0].aval.shape[found.row]
    batch = indices.shape[0]
    ids = indices[..., found.row_index].reshape(1, batch, 1, -1)
    y = jnp.moveaxis(grad, 1 + found.features, -1).reshape(1, batch, 1, ids.shape[3], -1)
    if lax.GatherScatterMode.from_any(eqn.params.get("mode")) != lax.GatherScatterMode.CLIP:
        inside = (ids >= 0) & (ids < rows)
        if found.column_index is not None:
            inside &= indices[..., found.column_index].reshape(ids.shape) == 0
        y = jnp.where(inside[..., None], y, jnp.zeros((), y.dtype))
    ids = jnp.clip(ids, 0, rows - 1)
    one_hot = Factor(ids=ids, size=rows, exponent=jnp.zeros_like(ids[:, :, 0, 0]))
    return one_hot, factor(y, acc)


def gram(a: Factor, b: Factor, acc):
    """``(L, B, H, Ka, Kb)``: the inner products of every row of `a` with every row of `b`."""
    if a.values is not None and b.values is not None:
        precision = higher(a.precision, b.precision)
        return jnp.einsum("lbhks,lbhjs->lbhkj", a.values, b.values, precision=precision)
    if a.values is None and b.values is None:
        return (a.ids[..., :, None] == b.ids[..., None, :]).astype(acc)
    if a.values is None:
        return jnp.swapaxes(gram(b, a, acc), -1, -2)
    # a dense (L, B, H, Ka, S), b one-hot (L, B, H, Kb): a[..., k, ids[..., l]]
    ids = jnp.broadcast_to(b.ids[..., None, :], (*a.values.shape[:4], b.ids.shape[3]))
    return jnp.take_along_axis(a.values, ids, axis=4)


def pair_term(x1: Factor, y1: Factor, x2: Factor, y2: Factor, acc):
    """``<g1, g2>`` per layer and example (scaled by the factors' exponents), by the Gram
    route."""
    # (the barrier: XLA on the CPU otherwise fuses both Grams and their product into one loop,
    # 1.5 to 2 times slower than the three apart)
    p, q = lax.optimization_barrier((gram(x1, x2, acc), gram(y1, y2, acc)))
    return jnp.sum(p * q, axis=(2, 3, 4))


def self_term(x: Factor, y: Factor, acc):
    """``||g||^2`` per layer and example: directly (``sum_k x_k y_k^T``, then its squares)
    where that takes fewer operations than the Gram route, else by the Gram route."""
    if x.values is not None and y.values is not None:
        k, c = x.values.shape[3:]
        f = y.values.shape[4]
        if k * (c + f) > c * f:
            precision = higher(x.precision, y.precision)
            g = jnp.einsum("lbhkc,lbhkf->lbhcf", x.values, y.values, precision=precision)
            # (no `optimization_barrier` before the squares: with one, XLA 0.10.2 on a CPU
            # computed wrong sums of squares of one example's product, nondeterministically:
            # a 1x1 convolution of 64 features over an 8x8 image was 1.1e-3 off, a
            # depthwise-separable network 0.28-1.99 off; without it, exact, and 1.08x slower
            # on the benchmark's convnet at 16)
            return jnp.sum(jnp.square(g), axis=(2, 3, 4))
    return pair_term(x, y, x, y, acc)


def safe(x: Factor, y: Factor):
    """Per layer and example (``(L, B)``): True where the use's terms can be computed without
    dividing its factors by their magnitudes, by the bounds ``|x| < 2**ex``, ``|y| < 2**ey``:
    no product or sum overflows float32, nor does a sum of up to ``2**27`` such terms (each
    at most ``2**100``); and the products small enough to flush to zero (below ``2**-126``)
    change it by less than ``2**-26`` of its largest product's scale, ``(2**(ex-1) *
    2**(ey-1))**2``, by either route (the Grams', whose flushed entries are multiplied by the
    other factor's, or the direct one's). Zero and non-finite factors are safe (their terms are
    0, or not finite, either way)."""
    (_, _, h, k, sx), sy = x.shape, y.shape[4]
    size = math.log2(h * k * k * (sx + 1) * (sy + 1))  # >= log2 of every count of products
    ex, ey = x.exponent.astype(jnp.float32), y.exponent.astype(jnp.float32)  # (as above)
    fits = (2 * (ex + ey) + size <= 100) & (2 * (ex + ey) >= size - 96) & (ex + ey >= size - 94)
    for e, s in ((ex, sx), (ey, sy)):  # each factor's own Gram
        fits &= (2 * e + math.log2(s) <= 110) & (2 * e >= size - 96)
    return fits | (ex == ZERO_EXPONENT) | (ey == ZERO_EXPONENT)


def _counted(exponent, value):
    """The exponent a term sets the scale of a sum by: its own, or `ZERO_EXPONENT` where its
    value is 0 (an unused leaf's, a leaf scaled by 0, a gradient whose rows cancel exactly,
    whose factors' exponents may be large): a zero must not set the scale, or every other
    term below it by more than float32's range flushes to 0."""
    return jnp.where(value == 0, ZERO_EXPONENT, exponent)


def over_layers(term):
    """The sum over the layers (axis 0) of squared norms given as ``(exponent, value)``."""
    exponent, value = term
    top = jnp.max(_counted(exponent, value), axis=0)
    return top, jnp.sum(_at_scale(value, exponent, top), axis=0)


def add_terms(terms):
    """The sum of squared norms given as ``(exponent, value)``, as ``(exponent, value)``."""
    top = _counted(*terms[0])
    for e, v in terms[1:]:
        top = jnp.maximum(top, _counted(e, v))
    return top, sum(_at_scale(v, e, top) for e, v in terms)


def _at_scale(value, exponent, top):
    """``value * 4**exponent`` as a multiple of ``4**top``; a zero unshifted (below a `top` of
    `ZERO_EXPONENT` the shift's derivative is infinite: NaN in the gradient through norms)."""
    return jnp.ldexp(value, jnp.where(value == 0, 0, 2 * (exponent - top)))


def combine(terms):
    """The norms (shape (B,)) of sums of squared norms given as ``(exponent, value)``."""
    top, total = add_terms(terms)
    return jnp.ldexp(_root(total), top)


def _root(total):
    """``sqrt(total)``, its derivative 0 at 0 (as the materialising way's norm), not NaN: the
    gradient through `clipped_grad` passes through the norms. NaN and infinity keep theirs."""
    return jnp.where(total == 0, 0, jnp.sqrt(jnp.where(total == 0, 1, total))).astype(total.dtype)
