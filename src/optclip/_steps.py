"""What every transformation's state shares: counters, the dtype of its norms, and the threshold
at a step (a number, a traced value or an Optax schedule)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optclip import _checks, _norm_rules


def counter():
    """A fresh int32 step or event counter."""
    return jnp.zeros((), jnp.int32)


def state_dtype(params):
    """The dtype of norms kept in a state: the accumulation dtype of the float leaves of
    `params` (float32, or float64 if any leaf is float64/complex128)."""
    leaves = [x for x in jax.tree.leaves(params) if is_inexact(x)]
    return _norm_rules.widest_accum_dtype([jnp.result_type(x) for x in leaves])


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
