"""The materialising way of `clipped_grad` (``method="vmap"``, the reference): every
example's gradient formed at once.

Both clip with optclip's scale (`_scale.clip_scale`: exact at any magnitude, 1 at a zero
gradient). An example is *kept* unless it is padding, or (with `nan_safe`) its norm is not
finite; a dropped example contributes exactly zero, a kept non-finite one makes the sum NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optclip.per_example import _clips
from optclip.per_example.ghost import _batch
from optclip.per_example.ghost._batch import Settings


def _vmap(fun, in_axes, s: Settings):
    return jax.vmap(fun, in_axes=in_axes, spmd_axis_name=s.spmd_axis_name)


def vmap_pass(one, args, kwargs, padding, s: Settings):
    """Per-example gradients materialised (`jax.vmap` of `jax.grad`), clipped and summed by
    `_per_example` (the reference). Returns ``(clipped sum, per-example norms, losses,
    aux)``."""

    def value_and_grad(*a):
        return jax.value_and_grad(lambda *p: one(p, a[-1]), argnums=s.argnums, has_aux=True)(
            *a[:-1]
        )

    (losses, aux), grads = _vmap(value_and_grad, (*s.axes, 0), s)(*args, kwargs)
    if s.pre_clipping_transform is not None:
        grads = _vmap(s.pre_clipping_transform, 0, s)(grads)
    if s.dtype is not None:
        grads = jax.tree.map(lambda g: g.astype(s.dtype), grads)
    leaves, treedef = jax.tree.flatten(grads)
    if leaves:
        norms = _clips.example_norms(leaves, per_leaf=False)
    else:  # (no parameters: every example's gradient is empty, of norm 0, as the ghost way's)
        norms = jnp.zeros(jnp.shape(losses)[:1], jnp.float32)
    w, keep, _ = _batch.weights(norms, padding, s)
    sums = _clips._sums(leaves, lambda i: w, keep, "zero")
    return jax.tree.unflatten(treedef, sums), norms, losses, aux
