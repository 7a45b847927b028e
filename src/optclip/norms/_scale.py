"""The scale every clip shares: ``threshold / max(norm, threshold)``, guarded, and applied to
each leaf by two multiplies fused into its consumer (the second factor is 1 unless the scale
is below float32's smallest normal number).

Its derivative is its own rule: JAX's rule for ``c / n`` forms ``n ** -2``, which leaves float32
for norms beyond ~9e18 or below ~5e-20 (a lost projection term, or inf and NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from optclip import _checks
from optclip.norms import _places


def threshold_as(value, dtype):
    """A checked threshold as a 0-d array of `dtype`, negative values raised to zero."""
    return jnp.maximum(_checks.as_array(value, dtype), 0)


@jax.custom_jvp
def _divide(a, b):
    """``a / b``, whose derivative never forms ``b ** 2`` (JAX's rule ``-a / b**2`` overflows
    for ``b`` beyond ~1.8e19 in float32 and underflows below ~1e-19, giving 0, inf or NaN)."""
    return a / b


@_divide.defjvp
def _divide_jvp(primals, tangents):
    (a, b), (da, db) = primals, tangents
    ratio = a / b
    return ratio, (da - ratio * db) / b


def clip_scale_parts(norm, threshold):
    """``threshold / max(norm, threshold)`` as two factors ``(scale, small)`` whose product it
    is: `small` is 1 unless the scale is below float32's smallest normal number (a tiny threshold
    against a large norm: ``1e-30 / 1e10``), where the scale alone would flush to zero and with
    it every leaf. Then both factors are powers of two apart from its square root, normal for
    every scale down to the square of the smallest normal number (~1e-76 in float32). Guarded as
    `clip_scale`."""
    over = norm > threshold
    denominator = jnp.where(over, norm, 1)
    # (float32's even for a float64 norm: the scale may be applied to float32 leaves of a
    # tree that also has float64 ones)
    tiny = jnp.finfo(jnp.float32).smallest_normal
    small = over & (lax.stop_gradient(threshold / denominator) < tiny)
    # The scale's exponent is about that of the threshold less the norm's; `small` takes half.
    _, threshold_exponent = jnp.frexp(lax.stop_gradient(threshold))
    _, norm_exponent = jnp.frexp(lax.stop_gradient(denominator))
    half = jnp.minimum(
        (norm_exponent - threshold_exponent + 1) // 2, jnp.finfo(norm.dtype).maxexp - 1
    )
    half = jnp.where(small, half, 0)
    numerator = jnp.where(over, threshold * jnp.ldexp(jnp.ones_like(denominator), half), 1)
    numerator = jnp.where(jnp.isfinite(norm) & ~jnp.isnan(threshold), numerator, jnp.nan)
    # Each factor ends with a division. XLA on CPU copies cheap scalar work (selects) into
    # every kernel that uses its result and evaluates it again for every element; it keeps a
    # division apart and passes the kernels its value.
    scale = _divide(numerator, denominator)
    return scale, 1 / jnp.ldexp(jnp.ones_like(scale), half)


def clip_scale(norm, threshold):
    """``threshold / max(norm, threshold)``, guarded: 1 at or under the threshold (zero included),
    NaN when the norm is not finite or the threshold is NaN (a traced NaN threshold is never a
    silent "no clip"). Finite gradient everywhere the norm is finite, at every magnitude.
    (A scale below the smallest normal number flushes to zero here: to apply one, use
    `clip_scale_parts`.)"""
    scale, small = clip_scale_parts(norm, threshold)
    return scale * small


def apply_scale(x, scale, small=None):
    """``x * scale`` (times `small`, the second factor of `clip_scale_parts`, if given) rounded
    once to `x`'s dtype (float16 and bfloat16 are scaled in float32; complex leaves part by
    part, so a signed zero keeps its sign); `x` itself, bit for bit, where the scale is 1 (XLA
    on CPU flushes subnormal numbers to zero in any arithmetic, ``x * 1`` included)."""
    x = jnp.asarray(x)
    scale = _places.on_devices_of(scale, x)  # eager leaves on several devices: scale each there
    if small is not None:  # (never != 1 where the scale is 1: it is then ~1e-19 or less)
        small = _places.on_devices_of(small, x)
    # Not `jnp.promote_types`: under jax_numpy_dtype_promotion='strict' it refuses bfloat16.
    work = x.dtype if jnp.finfo(x.dtype).bits >= 32 else jnp.dtype(jnp.float32)
    real = jnp.finfo(work).dtype  # the real dtype of the work (float32 for complex64)

    def times(part):
        part = part * scale.astype(real)
        return part if small is None else part * small.astype(real)

    if jnp.iscomplexobj(x):
        scaled = lax.complex(times(jnp.real(x)), times(jnp.imag(x)))
    else:
        scaled = times(x.astype(work)).astype(x.dtype)
    return jnp.where(scale == 1, x, scaled)


def scale_tree(tree, scale, small=None):
    """Every leaf of `tree` multiplied by the scalar `scale` (and `small`; see `apply_scale`)."""
    return jax.tree.map(lambda x: apply_scale(x, scale, small), tree)


def clip_leaves(leaves, norm, threshold, factor=None):
    """`leaves` (arrays whose 2-norm is `norm`, or slices of one array whose norms `norm`
    broadcasts against it) scaled down to `threshold` (0-d, in `norm`'s dtype, not negative),
    and then by `factor` if given (0-d: loss scaling's inverse scale).

    Its derivative is its own rule. Where the norm is over the threshold, the derivative in the
    direction ``dx`` is ``s (dx - u dn) + u dc`` with ``s`` the scale, ``u = x / n`` and ``dn``
    the norm's derivative. Its transpose forms ``u . (s g)``, whose terms are at most ``|s g|``.
    JAX's own rule forms ``x . g`` instead, which flushes to zero for a tiny ``x`` and ``g``
    (``1e-19 * 6e-28`` in float32) and loses the projection term."""
    factor = None if factor is None else jnp.asarray(factor)
    return _clip_leaves(list(leaves), jnp.asarray(norm), jnp.asarray(threshold), factor)


def clip_tree(tree, norm, threshold, factor=None):
    """Every leaf of `tree` scaled down by `clip_leaves` (the tree's global 2-norm `norm`)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, clip_leaves(leaves, norm, threshold, factor))


def clip(x, norm, threshold):
    """`x` (a leaf, or slices of it whose norms `norm` broadcasts against it) scaled down to
    the checked `threshold`."""
    return clip_leaves([x], norm, threshold_as(threshold, norm.dtype))[0]


@jax.custom_jvp
def _clip_leaves(leaves, norm, threshold, factor):
    scale, small = clip_scale_parts(norm, threshold)
    scale = scale if factor is None else scale * factor.astype(scale.dtype)
    return [apply_scale(x, scale, small) for x in leaves]


def _clip_leaves_jvp(primals, tangents):
    leaves, norm, threshold, factor = primals
    dleaves, dnorm, dthreshold, dfactor = tangents
    unscaled, small = clip_scale_parts(norm, threshold)
    scale = unscaled if factor is None else unscaled * factor.astype(unscaled.dtype)
    out = [apply_scale(x, scale, small) for x in leaves]
    clipped = norm > threshold
    denominator = jnp.where(clipped, norm, 1)
    along = None if _zero(dnorm) else jnp.where(clipped, dnorm, 0)
    across = None if _zero(dthreshold) else jnp.where(clipped, dthreshold, 0)
    if factor is not None and across is not None:
        across = across * factor.astype(across.dtype)
    dout = []
    for x, dx in zip(leaves, dleaves):
        # u = x / n, in a dtype that holds both (a float32 leaf of a tree with a float64 norm)
        work = jnp.result_type(x.dtype if jnp.finfo(x.dtype).bits >= 32 else jnp.float32, norm)
        unit = x.astype(work) / denominator.astype(work)
        step = jnp.zeros(x.shape, work) if _zero(dx) else dx.astype(work)
        if along is not None:
            step = step - unit * along.astype(work)
        t = apply_scale(step, scale, small)
        if across is not None:
            t = t + unit * across.astype(work)
        if not _zero(dfactor):
            t = t + apply_scale(x.astype(work), unscaled, small) * dfactor.astype(work)
        dout.append(t.astype(x.dtype))
    return out, dout


def _zero(tangent):
    return tangent is None or isinstance(tangent, SymbolicZero)


_clip_leaves.defjvp(_clip_leaves_jvp, symbolic_zeros=True)
