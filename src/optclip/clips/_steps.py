"""What every transformation's state shares: counters, the dtype of its norms, and the threshold
at a step (a number, a traced value or an Optax schedule)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import jax.numpy as jnp
import optax

from optclip import _checks
from optclip.norms import _groups, _norms, _reductions


def counter():
    """A fresh int32 step or event counter."""
    return jnp.zeros((), jnp.int32)


def state_dtype(params):
    """The dtype of norms kept in a state: the accumulation dtype of the float leaves of
    `params` (float32, or float64 if any leaf is float64/complex128), its leaves checked (every
    `init` that reads `params` goes through here)."""
    leaves = [x for _, x in _checks.check_leaves(params, "`init`") if is_inexact(x)]
    return _reductions.widest_accum_dtype([jnp.result_type(x) for x in leaves])


def is_inexact(x) -> bool:
    """A floating-point or complex leaf."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def as_dtype(value, dtype):
    """A (possibly traced, possibly bfloat16 from `inject_hyperparams`) scalar in `dtype`."""
    return jnp.asarray(value).astype(dtype)


def threshold_at(max_norm, count, name: str = "max_norm"):
    """The threshold for this step: `max_norm` itself or the schedule's value at `count` (`name`
    is the factory's argument, for the error on a bad schedule value)."""
    if _checks.is_schedule(max_norm):
        return _checks.check_scalar(max_norm(count), f"{name}(count)")
    return max_norm


# Transformations that can take gradients multiplied by a loss scale and clip them as if they
# had been divided by it, with no pass over them to unscale: ``update_fn -> unscaling``.
_UNSCALING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_unscaling(transform, unscaling: Callable):
    """Records that `transform` (an optax transformation built by optclip) has an unscaling
    update, and returns `transform`.

    ``unscaling(updates, state, params, inverse_scale)`` returns ``(the update for
    updates * inverse_scale, the state after it, the global norm of updates * inverse_scale or
    None)`` without computing ``updates * inverse_scale`` itself: the inverse scale is folded
    into the norms (a scalar each) and into the one factor each element is multiplied by, so the
    compiled step reads the gradients as often as without a loss scale. It must not refer to
    ``transform.update`` (the registry holds it weakly)."""
    _UNSCALING[transform.update] = unscaling
    return transform


def unscaling_of(transform) -> Callable | None:
    """The unscaling update registered for `transform`, or None."""
    update = getattr(transform, "update", None)
    try:
        return _UNSCALING.get(update)
    except TypeError:  # not weak-referenceable: not one of ours
        return None


def unscale_norms(norm, bucket_norms, inverse_scale):
    """The global and bucket norms of loss-scaled gradients, divided by the loss scale."""
    inverse_scale = inverse_scale.astype(norm.dtype)
    return norm * inverse_scale, bucket_norms * inverse_scale


def clip_norms(updates, field, spec, stacked, axis_name, what: str, inverse_scale=None, p=2.0):
    """``(global norm, group norms)`` of the updates of a clip whose state keeps group norms in
    `field` (`spec` and `stacked` as given to the factory): the groups checked against those the
    state was made with, and, for loss-scaled gradients, the norms of the unscaled ones."""
    buckets = _groups.layout(spec, stacked, updates, field, what, axis_name)
    norm, bucket_norms = _norms.norms_of(updates, p, axis_name, what, buckets)
    if inverse_scale is not None:
        norm, bucket_norms = unscale_norms(norm, bucket_norms, inverse_scale)
    return norm, bucket_norms


def global_norm_transform(init_fn, step):
    """The transformation of a clip by the global norm, from ``step(updates, state,
    inverse_scale=None)``, with its unscaling update registered (its state's `global_norm` is
    the norm of the unscaled gradients)."""

    def update_fn(updates, state, params=None):
        del params
        return step(updates, state)

    def unscaling(updates, state, params, inverse_scale):
        del params
        updates, state = step(updates, state, inverse_scale)
        return updates, state, state.global_norm

    return register_unscaling(optax.GradientTransformation(init_fn, update_fn), unscaling)
