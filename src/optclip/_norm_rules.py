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
caller's: `_norms` for leaves and trees, `_per_example` for batches of examples.
"""

from __future__ import annotations

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


def real_parts(x):
    """The real components of `x` in its accumulation dtype: ``(x,)`` or ``(re, im)``."""
    acc = accum_dtype(x.dtype)
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


def magnitude_power(x, p, inverse_scale=None):
    """``|x * inverse_scale| ** p`` elementwise, in the accumulation dtype (``|z|**2`` for
    complex)."""
    parts = real_parts(x)
    if inverse_scale is not None:
        parts = tuple(c * inverse_scale.astype(c.dtype) for c in parts)
    if len(parts) == 2:
        square = parts[0] * parts[0] + parts[1] * parts[1]
        if is_static(p) and p == 2.0:
            return square
        return pow0(square, p / 2)
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


def needs_rescale(total, p, zero_is_exact: bool):
    """Where a plain sum of powers lost the norm: it overflowed or underflowed (elementwise).

    A sum that is exactly zero comes from an all-zero input or from values whose powers all
    flushed to zero (below ~1e-19 for float32 squares). With `zero_is_exact` it is trusted, so
    that zero slices, common in per-slice clipping, do not take the slow path; orders above 2
    flush much sooner (``1e-5 ** 8``) and never trust it.
    """
    tiny = jnp.finfo(total.dtype).smallest_normal
    if zero_is_exact and is_static(p) and p <= 2.0:
        low = (total > 0) & (total < tiny)
    else:
        low = total < tiny
    return (total == jnp.inf) | low


def _rescaled_norm(largest: Callable, rescaled_total: Callable, p):
    """``m * (sum |x / m| ** p) ** (1/p)`` with ``m`` the largest magnitude (a power of two near
    it, so the scaling is exact): the norm when the plain sum overflowed or underflowed."""
    m = largest()
    # The norm does not depend on the scale, so no gradient flows through it (its derivative
    # would divide by scale**2, which overflows).
    scale, inverse = lax.stop_gradient(power_of_two_scale(m))
    norm = scale * root(rescaled_total(inverse), p)
    return jnp.where(m == jnp.inf, jnp.inf, norm)


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


def norm_with_rules(arrays, p, reduce, largest, expand, needs_rescale, rules: bool = True):
    """The `p`-norms of `arrays` (a list), with a batching rule and a differentiation rule.

    The norms may come in several "views" of the same arrays (per group of leaves, and of all of
    them), each a reduction of the same elementwise terms:

    * `reduce(terms)` reduces `terms[v][i]`, the elementwise terms of ``arrays[i]`` for view
      `v`, into the norms' shape (over some axes of one leaf; per group of leaves and then all
      of them);
    * `largest(arrays)` is the largest magnitude, reduced the same way;
    * `expand(values, i, array)` is, for each view, norm-shaped `values` broadcast against
      ``arrays[i]`` (a list, one entry per view);
    * `needs_rescale(total)` says, norm by norm, where a plain sum lost its norm.

    The norms themselves are `_safe_norm`'s. Two custom rules (with `rules`, for a static order
    and no collectives):

    * `vmap` (per-example clipping): a `lax.cond` with a batched predicate would become a
      `select` running both branches for every example; the rule keeps one `cond`, on whether
      any example needs the fallback.
    * differentiation: `d||x||_p = sum((|x|/n)**(p-2) * (x/n) * dx)`, with `x/n` computed with a
      power-of-two scale (no overflow, no flush to zero); zero at `n == 0`. This is the exact
      derivative of the norm, whichever branch computed it.
    """

    def totals(arrays, inverse_scale=None):
        if inverse_scale is None:
            plain = [magnitude_power(a, p) for a in arrays]  # shared by every view
            return reduce([plain] * len(expand(None, None, None)))
        per_array = [
            [magnitude_power(a, p, s) for s in expand(inverse_scale, i, a)]
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
        return compute(arrays)  # eager (no transformation to write rules for), or collectives

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

    @jax.custom_jvp
    def norm(arrays):
        return batched(arrays)

    @norm.defjvp
    def norm_jvp(primals, tangents):
        (arrays,), (darrays,) = primals, tangents
        n = norm(arrays)
        per_array = [
            [_norm_tangent(a, da, n_view, p) for n_view in expand(n, i, a)]
            for i, (a, da) in enumerate(zip(arrays, darrays))
        ]
        return n, reduce([list(view) for view in zip(*per_array)])

    return norm(arrays)


def _norm_tangent(x, dx, n, p: float):
    """Elementwise terms of the derivative of the `p`-norm `n` of `x` in the direction `dx`
    (`n` broadcasts against `x`)."""
    n_safe = jnp.where((n == 0) | ~jnp.isfinite(n), 1, n)
    _, inverse = power_of_two_scale(n_safe)
    n_scaled = n_safe * inverse  # in [0.5, 1): dividing by it is safe
    ratio = [c * inverse.astype(c.dtype) / n_scaled.astype(c.dtype) for c in real_parts(x)]
    directional = sum(r * d for r, d in zip(ratio, real_parts(jnp.asarray(dx, x.dtype))))
    if p != 2.0:
        magnitude = jnp.abs(ratio[0]) if len(ratio) == 1 else jnp.hypot(*ratio)
        directional = pow0(magnitude, p - 2) * directional
    return jnp.where(n == 0, 0, directional).astype(n.dtype)
