"""What a `clipped_grad` call was asked for and given: its settings, its arguments as flat
leaves, and each example's factor in the clipped sum."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optclip.norms import _scale


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `clipped_grad` was asked for, checked."""

    argnums: Any
    argnum_tuple: tuple
    axes: tuple
    l2_clip_norm: Any
    rescale_to_unit_norm: bool
    nan_safe: bool
    dtype: Any
    pre_clipping_transform: Any
    spmd_axis_name: Any


def weights(norms, padding, s: Settings):
    """Each example's factor in the clipped sum (0 for a dropped example) and which examples
    are kept."""
    threshold = _scale.threshold_as(s.l2_clip_norm, norms.dtype)
    scale = _scale.clip_scale(norms, threshold)
    if s.rescale_to_unit_norm:
        unit = jnp.where(norms > 0, 1 / jnp.where(norms > 0, norms, 1), 0)
        scale = jnp.where(threshold > 0, scale / jnp.where(threshold > 0, threshold, 1), unit)
    finite = jnp.isfinite(norms)
    keep = ~padding & (finite | (not s.nan_safe))
    return jnp.where(keep, scale, 0), keep, finite


@dataclasses.dataclass
class Flat:
    """The leaves of ``(args, kwargs)`` the loss is traced with (`leaves`, arrays), per leaf
    whether it is a parameter and whether it is batched, and `rebuild`, which gives
    ``(args, kwargs)`` back from such leaves with the static ones (Python numbers and bools
    that are neither differentiated nor batched, left as they are: as `jax.vmap` does, so that
    ``if flag:`` in the loss works) put back."""

    leaves: list
    params: list
    batched: list
    rebuild: Any
    static: list  # per leaf of ``(args, kwargs)``, whether it is left as it is


def flatten(args, kwargs, s: Settings) -> Flat:
    flat, tree = jax.tree.flatten((args, kwargs))
    params, batched = [], []
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        params += [i in s.argnum_tuple] * count
        batched += [s.axes[i] == 0] * count
    count = len(jax.tree.leaves(kwargs))
    params += [False] * count
    batched += [True] * count
    array = (jax.Array, np.ndarray, np.generic)
    static = [not (p or b or isinstance(x, array)) for x, p, b in zip(flat, params, batched)]

    def rebuild(leaves):
        leaves = iter(leaves)
        full = [x if st else next(leaves) for x, st in zip(flat, static, strict=True)]
        return jax.tree.unflatten(tree, full)

    keep = [i for i, st in enumerate(static) if not st]
    leaves = [flat[i] if isinstance(flat[i], jax.Array) else jnp.asarray(flat[i]) for i in keep]
    return Flat(leaves, [params[i] for i in keep], [batched[i] for i in keep], rebuild, static)


def one_example(flat: Flat) -> list:
    """The shapes and dtypes of one example's `flat.leaves`."""
    return [
        jax.ShapeDtypeStruct(x.shape[1:] if b else x.shape, x.dtype)
        for x, b in zip(flat.leaves, flat.batched, strict=True)
    ]


def flat_loss(one, flat: Flat):
    """One example's loss `one` as a function of `flat.leaves` (one example's)."""
    return lambda *leaves: one(*flat.rebuild(leaves))


def batch_axis_spec(like):
    """The mesh axis (or axes) `like`'s leading axis is split over, in JAX's explicit sharding
    mode; else None."""
    sharding = getattr(jax.typeof(like), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec[0] if spec else None


def batch_zeros(one, like, axis: int = 0):
    """Zeros of `one`'s shape and dtype for every example, the example axis at `axis`, split
    over the mesh like the batch `like` (explicit sharding refuses to `vmap` differently split
    inputs together)."""
    shape = (*one.shape[:axis], like.shape[0], *one.shape[axis:])
    split = batch_axis_spec(like)
    if split is None:
        return jnp.zeros(shape, one.dtype)
    spec = jax.sharding.PartitionSpec(*([None] * axis), split)
    return jnp.zeros(shape, one.dtype, out_sharding=spec)
