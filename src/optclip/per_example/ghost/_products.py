"""A product site's sum over the batch, ``sum_b (w_b g_b)`` for its parameter view, written out
as one product where JAX's own VJP of the batched equation computes it more slowly.

A dense layer's (`dense_view_sum`): one `dot_general` contracting the examples, as ordinary
backpropagation's (JAX's VJP puts the output gradient first and transposes the product after
it). A convolution's (`conv_view_sum`), on a CPU only: JAX's transposed convolution for the
kernel (the input and the output gradient, their examples merged into the images, as the
operands), with both operands transposed first into the layout XLA's CPU runtime convolves
fastest (``NHWC`` by ``HWIO``). Elsewhere the VJP's convolution is left to the backend's own
layouts. The measurements behind both are in the design notes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from optclip.per_example import _clips
from optclip.per_example.ghost import _factors
from optclip.per_example.ghost._target import Target


def dense_view_sum(site, value, record, cotangent, target: Target, depth: int):
    """The cotangent of a `dot_general` site's view (`value` its view stacked over `depth`
    levels) from the batch's other operand `record` and output gradient `cotangent` (both
    laid out ``(*levels, B, ...)``, the levels at which the view is the same at every step
    merged into the examples: `_sums._constants_merged`): one `dot_general` contracting the
    examples and the other operand's free dimensions (merged into one where they are
    adjacent, as ``(B*T, C)``), its operands in the order `_larger_last` picks, then
    transposed into the view's order where that differs. The VJP of the batched equation
    gives the same numbers, but always puts the output gradient first and lets XLA fold its
    transpose into the product. A float16 or bfloat16 view's product comes out in float32
    (its layers are added there)."""
    eqn, pos = site.eqn, site.views[0][0]
    o_batch, o_free, o_contract, out_o, _ = _factors.dense_dims(eqn, pos)
    v_contract, v_batch, v_free = _view_dims(eqn, pos)
    levels = list(range(depth))
    at = lambda dims: [depth + 1 + d for d in dims]  # noqa: E731
    r_sum, c_sum = [depth, *at(o_free)], [depth, *at(out_o)]
    r_batch, c_batch = levels + at(o_batch), levels + at(range(len(o_batch)))
    ones = [i for i, d in enumerate(r_sum) if record.shape[d] == 1]
    if ones and len(ones) < len(r_sum):  # (a pair of size-1 dimensions contracts nothing)
        record, r_sum, r_batch = _dropped(record, r_sum, r_batch, ones)
        cotangent, c_sum, c_batch = _dropped(cotangent, c_sum, c_batch, ones)
    if _adjacent(r_sum) and _adjacent(c_sum):
        record, r_sum, r_batch = _merged(record, r_sum, r_batch)
        cotangent, c_sum, c_batch = _merged(cotangent, c_sum, c_batch)
    # the product's dimensions as the view's: levels, heads, then the record's side (the
    # view's contracted dimensions, in the record's order) and the output gradient's (the
    # view's free ones), the larger side last (`_larger_last`)
    r_side = [v_contract[list(o_contract).index(d)] for d in sorted(o_contract)]
    rows = math.prod(record.shape[d] for d in r_sum)
    swap = _larger_last(value, depth, r_side, v_free, rows)
    order = [*v_batch, *(v_free + r_side if swap else r_side + v_free)]
    sharding = jax.typeof(value).sharding
    if sharding.mesh.empty or jax.sharding.AxisType.Explicit not in sharding.mesh.axis_types:
        out_sharding = None  # (automatic sharding: XLA's to choose, with or without a mesh set)
    else:
        spec = [*sharding.spec, *([None] * value.ndim)][: value.ndim]
        out_sharding = jax.sharding.PartitionSpec(*spec[:depth], *(spec[depth + d] for d in order))
    work = _clips._work_dtype(value.dtype)
    left, right = (record, r_sum, r_batch), (cotangent, c_sum, c_batch)
    left, right = (right, left) if swap else (left, right)
    product = functools.partial(
        lax.dot_general,
        dimension_numbers=((left[1], right[1]), (left[2], right[2])),
        precision=eqn.params["precision"],
        preferred_element_type=work
        if work != value.dtype
        else eqn.params["preferred_element_type"],
        out_sharding=out_sharding,
    )
    if jnp.dtype(jnp.bfloat16) in (record.dtype, cotangent.dtype):
        # XLA's CPU runtime has no bfloat16 product with a float32 result in some layouts
        # (seen with a weight on the left, and with one of several output features, as
        # attention's heads: "Unsupported element type for DotThunk::Execute: BF16 x BF16 =
        # F32"); where it has one, it converts both operands to float32 first. So a CPU gets
        # the operands in float32 (the same numbers).
        upcast = lambda a, b: product(a.astype(work), b.astype(work))  # noqa: E731
        out = upcast(left[0], right[0]) if target.cpu else product(left[0], right[0])
    else:
        out = product(left[0], right[0])
    perm = (*levels, *(depth + order.index(d) for d in range(value.ndim - depth)))
    if perm != tuple(range(value.ndim)):
        # (the barrier keeps XLA from folding the transpose into the product, which would
        # give it the other orientation)
        out = jnp.transpose(lax.optimization_barrier(out), perm)
    return out.astype(work)


def _larger_last(value, depth: int, r_side: list, c_side: list, rows: int) -> bool:
    """Whether a dense view's sum is taken with the output gradient's side first (its side
    the view's dimensions `c_side`, the record's `r_side`; `rows` contracted). XLA on a CPU
    contracts two row-major operands over their rows up to several times faster when the
    product's last dimension is the larger side; the product is then transposed into the
    view's order, a copy of the view's size. That copy is made only where each operand is at
    least the view's size (`rows` no fewer than either side); elsewhere, and where the sides
    are equal, the product comes out in the view's order. The choice is the same on every
    platform (no platform's branch to trace); on an accelerator it costs that copy alone."""
    size = lambda dims: math.prod(value.shape[depth + d] for d in dims)  # noqa: E731
    r_size, c_size = size(r_side), size(c_side)
    if r_size != c_size and rows >= max(r_size, c_size):
        return r_size > c_size
    return bool(c_side) and bool(r_side) and min(c_side) < min(r_side)


def _view_dims(eqn, pos: int):
    """A `dot_general`'s view (operand `pos`, one layer's): its contracted, batch and free
    dimensions."""
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    v_contract, v_batch = (contract_l, batch_l) if pos == 0 else (contract_r, batch_r)
    ndim = len(eqn.invars[pos].aval.shape)
    return v_contract, v_batch, [d for d in range(ndim) if d not in (*v_contract, *v_batch)]


def view_axis(site, axis: int) -> int:
    """The dimension of a `dot_general` site's view (one layer's) that its output's dimension
    `axis` (one of the view's free ones) runs along: where a block of the output gradient's
    features puts its block of the view's cotangent."""
    eqn, pos = site.eqn, site.views[0][0]
    return _view_dims(eqn, pos)[2][_factors.dense_dims(eqn, pos)[4].index(axis)]


def _adjacent(dims: list) -> bool:
    return dims == list(range(dims[0], dims[0] + len(dims)))


def _merged(x, summed: list, batch: list):
    """`x` with its `summed` dimensions (`_adjacent`) merged into one (XLA on the CPU
    contracts ``(B*T, C)`` faster than ``(B, T, C)`` over ``B, T``), and the dimension numbers
    after it."""
    n, start = len(summed), summed[0]
    x = x.reshape(*x.shape[:start], -1, *x.shape[start + n :])
    return x, [start], [d if d < start else d - n + 1 for d in batch]


def _dropped(x, summed: list, batch: list, ones: list):
    """`x` without the size-1 dimensions ``summed[i]`` for `ones`' ``i``, and the dimension
    numbers after it. Contracting them beside the examples (``(B*T, 1, C)`` with ``(B*T, O,
    1)``) makes XLA's CPU runtime transpose an operand before its product."""
    gone = [summed[i] for i in ones]
    shift = lambda d: d - sum(g < d for g in gone)  # noqa: E731
    x = x.reshape([n for d, n in enumerate(x.shape) if d not in gone])
    return x, [shift(d) for d in summed if d not in gone], [shift(d) for d in batch]


def conv_view_sum(site, value, record, cotangent, target: Target, depth: int):
    """On a CPU (elsewhere None: JAX's VJP of the batched equation), the cotangent of a
    convolution's kernel view (`value`, stacked over `depth` levels: the scans that slice it)
    from the batch's input `record` and output gradient `cotangent` (both laid out
    ``(*levels, B, ...)``, the levels at which the kernel is the same at every step merged into
    the examples): per level, the transposed convolution JAX's VJP forms for the kernel
    (``_conv_general_dilated_transpose_rhs``), the examples merged into the images, its
    operands laid out ``(C, *spatial, images)`` and ``(*spatial, images, O)`` and its output
    ``(I, *spatial, O)``. The levels one after another."""
    if not target.cpu:
        return None
    p = site.eqn.params
    kernel_shape = value.shape[depth:]
    work = _clips._work_dtype(value.dtype)
    if record.size == 0 or cotangent.size == 0:
        return jnp.zeros(value.shape, work)
    levels = value.shape[:depth]
    count = math.prod(levels)
    record = record.reshape(count, *record.shape[depth:])
    cotangent = cotangent.reshape(count, *cotangent.shape[depth:])
    one = functools.partial(_conv_kernel_sum, p, kernel_shape, work)
    if count == 1:
        out = one((record[0], cotangent[0]))[None]
    else:
        out = lax.map(one, (record, cotangent))
    return out.reshape(value.shape)


def _conv_kernel_sum(p, kernel_shape, work, operands):
    """One level's kernel cotangent, ``sum_b`` over the examples of `operands` = ``(record,
    cotangent)``, laid out ``(B, ...)`` as the site's equation lays out one example's."""
    record, cotangent = operands
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    nd = len(lhs_spec) - 2
    at = lambda spec: [1 + d for d in spec]  # noqa: E731  (past the examples' axis)
    lhs, out = at(lhs_spec), at(out_spec)
    # (C, *spatial, B, N) and (*spatial, B, N, O), the examples merged into the images
    x = jnp.transpose(record, (lhs[1], *lhs[2:], 0, lhs[0]))
    x = x.reshape(*x.shape[: nd + 1], -1)
    g = jnp.transpose(cotangent, (*out[2:], 0, out[0], out[1]))
    g = g.reshape(*g.shape[:nd], -1, g.shape[-1])
    window = [kernel_shape[d] for d in rhs_spec[2:]]
    pads = _kernel_padding(
        x.shape[1 : nd + 1],
        window,
        p["window_strides"],
        g.shape[:nd],
        p["padding"],
        p["lhs_dilation"],
        p["rhs_dilation"],
    )
    spatial = tuple(range(1, nd + 1))
    dn = lax.ConvDimensionNumbers(
        (0, nd + 1, *spatial), (nd + 1, nd, *range(nd)), (0, nd + 1, *spatial)
    )
    y = lax.conv_general_dilated(
        x,
        g,
        window_strides=p["rhs_dilation"],
        padding=pads,
        lhs_dilation=p["lhs_dilation"],
        rhs_dilation=p["window_strides"],
        dimension_numbers=dn,
        batch_group_count=p["feature_group_count"],
        precision=p["precision"],
        preferred_element_type=work,
    )  # (I, *window, O)
    source = {rhs_spec[0]: nd + 1, rhs_spec[1]: 0}
    source |= {d: 1 + i for i, d in enumerate(rhs_spec[2:])}
    return jnp.transpose(y, [source[d] for d in range(nd + 2)]).astype(work)


def _kernel_padding(in_shape, window, strides, out_shape, padding, lhs_dilation, rhs_dilation):
    """The padding of the kernel's transposed convolution (as JAX's
    ``_conv_general_vjp_rhs_padding``): the low padding of the layer's, the high one what
    makes its output the kernel's window."""
    dilated = lambda n, d: 0 if n == 0 else (n - 1) * d + 1  # noqa: E731
    out = []
    for i, (lo, _) in enumerate(padding):
        x = dilated(in_shape[i], lhs_dilation[i])
        k = dilated(window[i], rhs_dilation[i])
        y = dilated(out_shape[i], strides[i])
        out.append((lo, (y - x) + (k - lo - 1)))
    return out
