"""A ghost leaf's squared per-example norm as the sum over every pair of its uses, each use
scaled by its own number (its view's `_views.View.scale`).

A leaf used twice, once scaled by ``s1`` and once by ``s2`` (``x @ (w * 0.5)`` and ``h @ w``;
a tied embedding whose output use carries muP's multiplier), has the per-example gradient
``s1 g1 + s2 g2``, whose squared norm is ``s1**2 ||g1||**2 + 2 s1 s2 <g1, g2> + s2**2
||g2||**2``: each pair's term times the product of its numbers, with their signs. Each number is
carried as ``m * 2**k`` (`parts`: ``|m|`` in [0.5, 1), NaN where the number is not finite), its
power of two in the term's exponent, so that a number whose square overflows or flushes
(``1e25``, ``1e-25``) keeps the norm exact, as the factors' own magnitudes do
(`_factors.Factor.scaled`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from optclip.ghost import _factors


def parts(scale, dtype):
    """``(m, k)`` with ``scale = m * 2**k``, ``|m|`` in [0.5, 1) (0 for 0): Python numbers for a
    float `scale`; for a traced one (`_views.traced`), arrays computed on the device, `m` in
    `dtype` taken from the number itself (times exact powers of two) so that a gradient with
    respect to it passes, NaN where it is not finite (the materialising way's per-example
    gradients are NaN there: infinity times the zero of an entry)."""
    if isinstance(scale, float):
        return math.frexp(scale)
    work = jnp.promote_types(scale.dtype, jnp.float32)
    s = scale.astype(work)
    _, k = jnp.frexp(lax.stop_gradient(s))
    low, high = _factors.powers_of_two(-k, work)
    m = s * low * high
    m = jnp.where(jnp.isfinite(m), m, jnp.asarray(jnp.nan, work)).astype(dtype)
    return m, k.astype(jnp.int32)


def leaf_terms(uses, acc, scaled: bool = True, scales=None):
    """``(exponent, value)`` of one leaf's squared norm per layer and example, shape ``(L,
    B)``, from its uses' factors ``[(x, y)]`` (aligned to one layout), each use times its
    number in `scales` (None: every use's is 1): the sum over every pair of uses. With
    `scaled`, each factor is first divided by its magnitude (exact at every magnitude);
    without, as it is (where every use is `_factors.safe`, the same values: a power of two
    divides exactly). Each pair's term is carried with its own exponent and added by
    `_factors.add_terms`, so that a pair whose term is 0 (a use whose gradient is zero for
    that example, scaled by a huge number) does not set the scale the others are shifted to:
    they would flush."""
    weights = [parts(s, acc) for s in scales] if scales else [(1.0, 0)] * len(uses)
    if scaled:
        exponents = [x.exponent + y.exponent for x, y in uses]
        uses = [(x.scaled(), y.scaled()) for x, y in uses]
    else:
        exponents = [jnp.zeros_like(y.exponent) for _, y in uses]  # (split like the batch)
    exponents = [e + k for e, (_, k) in zip(exponents, weights, strict=True)]
    terms = []
    for i, (xi, yi) in enumerate(uses):
        for j in range(i, len(uses)):
            xj, yj = uses[j]
            if i == j:
                term = _factors.self_term(xi, yi, acc)
            else:
                term = 2 * _factors.pair_term(xi, yi, xj, yj, acc)
            m = weights[i][0] * weights[j][0]
            term = term if isinstance(m, float) and m == 1.0 else term * m
            e = exponents[i] + exponents[j]  # (the term is ``term * 2**e``: an odd `e`'s
            terms.append((e // 2, jnp.ldexp(term, e % 2)))  # last 2 into the value)
    if len(terms) == 1:
        return terms[0][0], jnp.maximum(terms[0][1], 0)
    exponent, value = _factors.add_terms(terms)
    return exponent, jnp.maximum(value, 0)
