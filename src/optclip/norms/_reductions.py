"""Norms from elementwise terms: the overflow and underflow fallback, and the batching and
differentiation rules every norm of optclip shares.

* Accumulation: float32 for float16, bfloat16, float32 and complex64 leaves; float64 for float64
  and complex128 leaves; across leaves in the widest of these.
* Overflow and underflow: the plain sum of ``|x|**p`` is computed first. Only when it overflows
  (``inf``) or underflows (below the smallest normal number) is the norm computed again with every
  value divided by the largest magnitude, under `lax.cond`, so the common path pays one scalar
  comparison.
* Gradients: square roots and fractional powers are guarded so that the gradient is finite
  everywhere, zero input included; the norm's derivative is its own rule (`norm_with_rules`).
* Batching: under `vmap` (per-example clipping) one `cond` decides the fallback for the whole
  batch.

How the terms are reduced (one leaf, slices of it, groups of leaves, across devices) is the
caller's: `_norms` for leaves and trees, `per_example._clips` for batches of examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def accum_dtype(dtype) -> np.dtype:
    """The real dtype a leaf's norm is accumulated in."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.float64), jnp.dtype(jnp.complex128)):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def widest_accum_dtype(dtypes: Sequence) -> np.dtype:
    """The accumulation dtype for a set of leaves: float64 if any leaf needs it."""
    accs = {accum_dtype(d) for d in dtypes}
    return jnp.dtype(jnp.float64) if jnp.dtype(jnp.float64) in accs else jnp.dtype(jnp.float32)


def is_static(p) -> bool:
    return isinstance(p, float)


def pow0(a, q):
    """``a ** q`` for ``a >= 0`` with a finite gradient at ``a == 0`` (for ``q < 1`` too)."""
    if is_static(q) and q == 1.0:
        return a
    if is_static(q) and q > 1.0:
        return a**q
    zero = a == 0  # (not `a > 0`, which would turn NaN into 0)
    return jnp.where(zero, 0, jnp.where(zero, 1, a) ** q)


def root(total, p):
    """``total ** (1 / p)`` with a finite gradient at zero."""
    if is_static(p) and p == 1.0:
        return total
    if is_static(p) and p == 2.0:
        zero = total == 0
        return jnp.where(zero, 0, jnp.sqrt(jnp.where(zero, 1, total)))
    return pow0(total, 1 / p)


def real_parts(x, acc=None):
    """The real components of `x` in its accumulation dtype (or `acc`, the accumulation dtype
    of the tree it belongs to: a float32 leaf of a tree with float64 leaves is accumulated in
    float64): ``(x,)`` or ``(re, im)``."""
    acc = accum_dtype(x.dtype) if acc is None else acc
    if jnp.iscomplexobj(x):
        return jnp.real(x).astype(acc), jnp.imag(x).astype(acc)
    return (x.astype(acc),)


def power_of_two_scale(m):
    """A power of two within a factor 2 of ``m > 0`` (1 for zero or non-finite ``m``), and its
    reciprocal; both are normal numbers, so scaling by them is exact.

    (Dividing by ``m`` itself is not safe: XLA may multiply by ``1 / m``, which for ``m > 2**126``
    is subnormal and flushed to zero.)
    """
    info = jnp.finfo(m.dtype)
    _, exponent = jnp.frexp(m)
    exponent = jnp.clip(exponent, info.minexp, info.maxexp - 2)
    exponent = jnp.where((m > 0) & (m < jnp.inf), exponent, 0)
    one = jnp.ones_like(m)
    return jnp.ldexp(one, exponent), jnp.ldexp(one, -exponent)


def magnitude_power(x, p, inverse_scale=None, acc=None):
    """``|x * inverse_scale| ** p`` elementwise, in the accumulation dtype (or `acc`; see
    `real_parts`); for complex `x`, ``re**2 + im**2`` when ``p == 2``, else ``|z| ** p``."""
    parts = real_parts(x, acc)
    if inverse_scale is not None:
        parts = tuple(c * inverse_scale.astype(c.dtype) for c in parts)
    if len(parts) == 2:
        re, im = parts
        if is_static(p) and p == 2.0:
            return re * re + im * im
        # |z| itself, not the square's root: the square of |z| < ~1e-19 flushes to zero.
        zero = (re == 0) & (im == 0)
        return pow0(jnp.where(zero, 0, jnp.hypot(jnp.where(zero, 1, re), im)), p)
    (a,) = parts
    if is_static(p) and p == 2.0:
        return a * a
    return pow0(jnp.abs(a), p)


def part_magnitude(x):
    """``max(|re|, |im|)`` elementwise in `x`'s own dtype (``|x|`` for real `x`): within a factor
    sqrt(2) of ``|x|``, which is all a scale needs, and its maximum is exact in the leaf's dtype
    (so it is taken there and only the result is converted)."""
    if jnp.iscomplexobj(x):
        return jnp.maximum(jnp.abs(jnp.real(x)), jnp.abs(jnp.imag(x)))
    return jnp.abs(x)


def magnitude(x):
    """``|x|`` elementwise (exact for complex, with a finite gradient at zero)."""
    if not jnp.iscomplexobj(x):
        return jnp.abs(x)
    z = x.astype(jnp.promote_types(x.dtype, jnp.complex64))
    nonzero = z != 0
    return jnp.where(nonzero, jnp.abs(jnp.where(nonzero, z, 1)), 0)


def sum_over(a, axis):
    return jnp.sum(a, axis=axis)


def max_over(a, axis):
    return jnp.max(a, axis=axis, initial=0)


def nan_count_over(a, axis):
    """How many elements of `a` are NaN, over `axis`, as a float of `a`'s dtype."""
    return jnp.sum(jnp.isnan(a), axis=axis, dtype=a.dtype)


def max_norm(largest, nan_count):
    """The infinity norm from the largest magnitudes and the number of NaN among them: NaN
    wherever a NaN was counted.

    A max-reduction alone cannot be trusted with NaN: XLA on CPU reduces large arrays (4096
    elements and more) with vector instructions whose maximum drops a NaN operand, so the answer
    may be finite (or -inf, clamped to 0 by the initial value). A sum of NaN counts cannot lose
    them."""
    return jnp.where(nan_count > 0, jnp.nan, largest)


def leaf_max_norm(magnitudes, axis=None, keepdims=False):
    """`max_norm` of `magnitudes` over `axis` (all of it by default)."""
    largest = jnp.max(magnitudes, axis=axis, keepdims=keepdims, initial=0)
    nan_count = jnp.sum(jnp.isnan(magnitudes), axis=axis, keepdims=keepdims)
    return max_norm(largest, nan_count)


# A sum of `count` powers is trusted above `count * smallest_normal * UNDERFLOW_MARGIN`: each
# power that flushed to zero was below the smallest normal number, so together they are at
# most 2**-30 of such a sum. (For float32 squares, a root mean square below ~3.5e-15 takes the
# rescaled path; no ordinary gradient is that small.) The margin also covers sums of pieces
# split over up to 2**6 devices, each counting only its own elements.
UNDERFLOW_MARGIN = 2.0**30


def needs_rescale(total, p, count, zero_is_exact: bool = False):
    """Where a plain sum of `count` powers (an int, or a NumPy array of one per sum) lost the
    norm (elementwise): it overflowed (``inf``),
    or it is small enough that powers which flushed to zero (below the smallest normal number)
    could matter in it.

    A sum that is exactly zero comes from an all-zero input or from values whose powers all
    flushed to zero (below ~1e-19 for float32 squares). With `zero_is_exact` it is trusted, so
    that zero slices (embedding rows, padding examples, frozen layers) do not send every step
    down the slow path; such a slice's norm is then 0 instead of at most `hidden_norm(count)`.
    Orders above 2 flush much sooner (``1e-5 ** 8``) and never trust it.
    """
    tiny = float(jnp.finfo(total.dtype).smallest_normal)
    bound = np.asarray(np.maximum(count, 1) * tiny * UNDERFLOW_MARGIN, total.dtype)
    if zero_is_exact and is_static(p) and p <= 2.0:
        low = (total > 0) & (total < bound)
    else:
        low = total < bound
    return (total == jnp.inf) | low


def hidden_norm(count: int, dtype) -> float:
    """The largest 2-norm that `count` values can have when all their squares flushed to zero
    in `dtype`: a clip at a threshold at least this large treats them the same whether their
    norm is taken to be 0 or computed exactly."""
    return math.sqrt(max(count, 1) * float(jnp.finfo(dtype).smallest_normal))


def _rescaled_norm(largest: Callable, rescaled_total: Callable, p):
    """``m * (sum |x / m| ** p) ** (1/p)`` with ``m`` the largest magnitude (a power of two near
    it, so the scaling is exact): the norm when the plain sum overflowed or underflowed."""
    m = largest()
    # The norm does not depend on the scale, so no gradient flows through it (its derivative
    # would divide by scale**2, which overflows).
    scale, inverse = lax.stop_gradient(power_of_two_scale(m))
    norm = scale * root(rescaled_total(inverse), p)
    return jnp.where((m == jnp.inf) & ~jnp.isnan(norm), jnp.inf, norm)


def _safe_norm(total, p, largest: Callable, rescaled_total: Callable, needs):
    """The norms from plain sums of powers `total`, or, where `needs` says a sum lost its norm,
    from rescaled ones.

    `largest()` gives the largest magnitudes and `rescaled_total(inverse_scale)` the sums of
    ``|x * inverse_scale| ** p`` (both shaped like `total`); they are only evaluated when some
    plain sum overflowed or underflowed.
    """

    def plain():
        return root(total, p)

    def rescaled():
        return _rescaled_norm(largest, rescaled_total, p).astype(total.dtype)

    needs_rescale = jnp.any(needs)
    if not isinstance(needs_rescale, jax.core.Tracer):
        # Eager: decide in Python rather than trace and compile a `cond` on every call.
        return rescaled() if bool(needs_rescale) else plain()
    return lax.cond(needs_rescale, rescaled, plain)


def _batched(compute, totals, largest, needs_rescale, p):
    """`compute` with `norm_with_rules`' batching rule: one `cond` for the whole batch."""

    @jax.custom_batching.custom_vmap
    def batched(arrays):
        return compute(arrays)

    @batched.def_vmap
    def batched_rule(axis_size, in_batched, arrays):
        del axis_size
        flags = in_batched[0]
        if not any(flags):
            return compute(arrays), False
        in_axes = ([0 if flag else None for flag in flags],)
        total = jax.vmap(totals, in_axes=in_axes)(arrays)
        plain = root(total, p)
        needs = jax.vmap(needs_rescale)(total)

        def with_fallback():
            rescaled = jax.vmap(
                lambda a: _rescaled_norm(lambda: largest(a), lambda inv: totals(a, inv), p),
                in_axes=in_axes,
            )(arrays)
            return jnp.where(needs, rescaled.astype(plain.dtype), plain)

        return lax.cond(jnp.any(needs), with_fallback, lambda: plain), True

    return batched


def norm_with_rules(
    arrays,
    p,
    reduce,
    largest,
    expand,
    needs_rescale,
    rules: bool = True,
    collectives: bool = False,
    acc=None,
):
    """The `p`-norms of `arrays` (a list), with a batching rule and a differentiation rule.

    The norms may come in several "views" of the same arrays (per group of leaves, and of all of
    them), each a reduction of the same elementwise terms:

    * `reduce(terms)` reduces `terms[v][i]`, the elementwise terms of ``arrays[i]`` for view
      `v`, into the norms' shape (over some axes of one leaf; per group of leaves and then all
      of them);
    * `largest(arrays)` is the largest magnitude, reduced the same way;
    * `expand(values, i, array)` is, for each view, norm-shaped `values` broadcast against
      ``arrays[i]`` (a list, one entry per view);
    * `needs_rescale(total)` says, norm by norm, where a plain sum lost its norm;
    * `acc` is the dtype every array is accumulated in (default: each its own, `accum_dtype`);
      a tree mixing float64 and float32 leaves accumulates all of them in float64, so that a
      float64 scale of the fallback is never cast to float32 (where ``2**665`` is inf).

    The norms themselves are `_safe_norm`'s. Two custom rules (with `rules`, for a static order;
    the batching rule only without `collectives`, the all-reduces inside `shard_map` or `pmap`
    that `reduce` ends with):

    * `vmap` (per-example clipping): a `lax.cond` with a batched predicate would become a
      `select` running both branches for every example; the rule keeps one `cond`, on whether
      any example needs the fallback.
    * differentiation: `d||x||_p = sum((|x|/n)**(p-1) * Re(conj(x/|x|) dx))`, formed so that
      nothing overflows or flushes to zero at any magnitude; zero at `n == 0`. This is the exact
      derivative of the norm, whichever branch computed it (`_norm_tangent`).
    """

    def totals(arrays, inverse_scale=None):
        if inverse_scale is None:
            plain = [magnitude_power(a, p, acc=acc) for a in arrays]  # shared by every view
            return reduce([plain] * len(expand(None, None, None)))
        per_array = [
            [magnitude_power(a, p, s, acc) for s in expand(inverse_scale, i, a)]
            for i, a in enumerate(arrays)
        ]
        return reduce([list(view) for view in zip(*per_array)])

    def compute(arrays):
        total = totals(arrays)
        return _safe_norm(
            total,
            p,
            lambda: largest(arrays),
            lambda inv: totals(arrays, inv),
            needs_rescale(total),
        )

    if not rules or not any(isinstance(a, jax.core.Tracer) for a in arrays):
        return compute(arrays)  # eager (no transformation to write rules for), or traced order

    if collectives:  # (no batching rule: inside shard_map the arrays are a device's pieces)
        batched = compute
    else:
        batched = _batched(compute, totals, largest, needs_rescale, p)

    @jax.custom_jvp
    def norm(arrays):
        return batched(arrays)

    @norm.defjvp
    def norm_jvp(primals, tangents):
        (arrays,), (darrays,) = primals, tangents
        n = norm(arrays)
        per_array = [
            [_norm_tangent(a, da, n_view, p, acc) for n_view in expand(n, i, a)]
            for i, (a, da) in enumerate(zip(arrays, darrays))
        ]
        return n, reduce([list(view) for view in zip(*per_array)])

    return norm(arrays)


def _norm_tangent(x, dx, n, p: float, acc=None):
    r"""Elementwise terms of the derivative of the `p`-norm `n` of `x` in the direction `dx`
    (`n` broadcasts against `x`):

    .. math::
        dn = \sum_i w_i \, \mathrm{Re}(\bar u_i \, dx_i), \quad
        w_i = (|x_i| / n)^{p-1}, \quad u_i = x_i / |x_i|

    For ``p == 2`` that is ``Re(conj(x_i) / n * dx_i)``, with ``x / n`` formed through a power of
    two near `n` (no overflow of ``n**2``, which JAX's own rule for ``sqrt`` would form). For
    other orders the weight is ``exp((p - 1) * (log|x_i| - log n))``: the ratio ``|x_i| / n``
    itself may be below the smallest normal number (``1 / 3e38``) and flush to zero, while its
    power (1 for ``p == 1``, large for ``p < 1``) is finite. Zero terms where ``x_i == 0`` (a
    subgradient for ``p <= 1``) or ``n == 0``.
    """
    out_dtype = n.dtype
    parts = real_parts(x, acc)
    dparts = real_parts(jnp.asarray(dx, x.dtype), acc)
    n = n.astype(parts[0].dtype)
    n_safe = jnp.where((n == 0) | ~jnp.isfinite(n), 1, n)
    if p == 2.0:
        _, inverse = power_of_two_scale(n_safe)
        n_scaled = n_safe * inverse  # in [0.5, 1): dividing by it is safe
        directional = sum((c * inverse) / n_scaled * d for c, d in zip(parts, dparts))
        return jnp.where(n == 0, 0, directional).astype(out_dtype)
    # |x_i| and the unit u_i, through a power of two near max(|re|, |im|): exact for tiny and
    # huge values alike.
    largest = parts[0] if len(parts) == 1 else jnp.maximum(*(jnp.abs(c) for c in parts))
    big, small = power_of_two_scale(jnp.abs(largest))
    scaled = [c * small for c in parts]  # the largest part in [0.5, 1)
    length = jnp.abs(scaled[0]) if len(parts) == 1 else jnp.hypot(*scaled)
    nonzero = length > 0
    length_safe = jnp.where(nonzero, length, 1)
    along = sum(c / length_safe * d for c, d in zip(scaled, dparts))  # Re(conj(u) dx)
    if p == 1.0:
        weight = jnp.ones_like(length)
    else:
        log_ratio = jnp.log(length_safe) + jnp.log(big) - jnp.log(n_safe)
        weight = jnp.exp((p - 1) * jnp.minimum(log_ratio, 0))  # |x_i| <= n: the ratio is <= 1
    return jnp.where((n == 0) | ~nonzero, 0, weight * along).astype(out_dtype)
