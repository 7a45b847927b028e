"""Non-finite norms: the policies every global clip shares ("propagate", "zero", "raise"), and
the error they raise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from optclip import _checks, _errors
from optclip.norms import _axes, _scale


class NonFiniteNormError(FloatingPointError):
    """The norm of the updates is NaN or inf, and the clip was asked to raise
    (``nonfinite="raise"``, PyTorch's ``error_if_nonfinite=True``)."""


def raise_if_nonfinite(norm, tree, what: str) -> None:
    """Raises `NonFiniteNormError` naming the leaves with NaN or inf if `norm` is not finite.

    Eager: at once, before anything is updated. Under `jit`: from a host callback that only runs
    on a non-finite step (a `lax.cond` on the norm), so the step's results are never delivered;
    JAX re-raises it as its runtime error, with this message, and `optclip.reraise_errors`
    turns that back into this error.
    """
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [_checks.leaf_name(path) for path, _ in paths_and_leaves]
    # Under shard_map/pmap each device sees its own pieces: the NaN may be in another's.
    none = (
        "none here (the norm itself overflowed, or the NaN or inf is on another device)"
        if _axes.bound_axis_names()
        else "none (the norm itself overflowed)"
    )

    def error(norm_value, finite_leaves):
        bad = [name for name, ok in zip(names, finite_leaves) if not np.all(ok)]
        return NonFiniteNormError(
            f"`{what}`: the norm of the updates is {norm_value}, not finite; leaves with NaN or "
            f"inf: {', '.join(f'`{b}`' for b in bad) or none}. "
            "(`nonfinite='raise'`; 'propagate' makes the update NaN, 'zero' drops it.)"
        )

    def report(norm_value, finite_leaves):
        norm_value = np.asarray(norm_value)
        if np.all(np.isfinite(norm_value)):
            return  # (a batched `cond` runs this branch for every example)
        _errors.raise_from_callback(error(norm_value, finite_leaves))

    def finite_leaves():
        return [jnp.all(jnp.isfinite(leaf)) for _, leaf in paths_and_leaves]

    finite = jnp.all(jnp.isfinite(norm))
    if not _checks.is_traced(finite):
        if not bool(finite):
            raise error(np.asarray(norm), [bool(ok) for ok in finite_leaves()])
        return
    jax.lax.cond(finite, lambda: None, lambda: jax.debug.callback(report, norm, finite_leaves()))


def clip_to_threshold(updates, norm, threshold, nonfinite: str, what: str, inverse_scale=None):
    """``(updates scaled down to `threshold`, the scale applied)`` for `updates` of global norm
    `norm`, with the non-finite policy: "propagate" (NaN everywhere), "zero" (zeros, scale 0) or
    "raise" (`raise_if_nonfinite`).

    With `inverse_scale`, `updates` are loss-scaled gradients and `norm` is already their
    unscaled norm: every element is multiplied once, by the scale times `inverse_scale`."""
    if nonfinite == "raise":
        raise_if_nonfinite(norm, updates, what)
    threshold = _scale.threshold_as(threshold, norm.dtype)
    updates = _scale.clip_tree(updates, norm, threshold, inverse_scale)
    scale = _scale.clip_scale(norm, threshold)
    if nonfinite == "zero":
        finite = jnp.isfinite(norm)
        updates = zero_unless(finite, updates)
        scale = jnp.where(finite, scale, 0)
    return updates, scale


def zero_unless(ok, tree):
    """`tree` where `ok`, zeros of the same dtypes elsewhere."""
    return jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), tree)


def skip_unless(ok, updates, new_state, old_state):
    """A true skipped step where `ok` is False: the updates become zeros and the wrapped
    optimizer's state stays `old_state`, bit for bit (a `where` on every leaf: no `cond`, so it
    batches, and XLA fuses it into the optimizer's own update)."""
    updates = zero_unless(ok, updates)
    state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, old_state)
    return updates, state
