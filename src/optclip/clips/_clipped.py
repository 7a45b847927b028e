"""Keras' optimizer arguments (`clipnorm`, `clipvalue`, `global_clipnorm`) for any Optax
optimizer, and a true skipped step on a non-finite gradient."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optclip import _checks
from optclip.clips import _nonfinite, _steps
from optclip.clips._transforms import global_clip, norm_clip, value_clip
from optclip.norms import _norms


class ClippedState(NamedTuple):
    """State of :func:`clipped`: the clip's, the wrapped optimizer's, and the skipped steps."""

    clip_state: optax.OptState
    inner_state: optax.OptState
    skip_count: jax.Array  # steps dropped because the gradient's norm was not finite


def _check_optimizer(optimizer, arg: str = "optimizer", example: str = "optax.adam(1e-3)") -> None:
    """`clipped` wraps a transformation: not an optimizer's factory, nor anything else."""
    if (
        not isinstance(optimizer, type)
        and not _checks.is_factory(optimizer)
        and callable(getattr(optimizer, "init", None))
        and callable(getattr(optimizer, "update", None))
    ):
        return
    accepted = f"an optax.GradientTransformation such as `{example}`"
    if callable(optimizer):
        kind = "class" if isinstance(optimizer, type) else "function"
        name = getattr(optimizer, "__name__", None) or repr(optimizer)
        raise TypeError(f"`{arg}` must be {accepted}; got the {kind} `{name}` (call it first).")
    raise TypeError(f"`{arg}` must be {accepted}; got {type(optimizer).__name__}: {optimizer!r}.")


def _keras_threshold(value):
    """Keras' rule for `clipped`: a threshold <= 0 turns the clip off (inf), concrete or traced,
    or a schedule's value; NaN stays NaN (so a traced NaN is never a silent "no clip")."""
    if _checks.is_schedule(value):
        return lambda count: _keras_threshold(value(count))
    known = _checks.concrete(value)
    if known is not None:
        return np.inf if known.shape == () and known <= 0 else value
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.floating):
        value = value.astype(jnp.float32)
    return jnp.where(value <= 0, jnp.array(jnp.inf, value.dtype), value)


@_checks.factory
def clipped(
    optimizer,
    *,
    clipnorm=None,
    clipvalue=None,
    global_clipnorm=None,
    nonfinite="propagate",
) -> optax.GradientTransformationExtraArgs:
    r"""Keras-style clipping arguments for any Optax optimizer: clip, then `optimizer`.

    ``keras.optimizers.Adam(1e-3, clipnorm=1.0)`` is ``clipped(optax.adam(1e-3), clipnorm=1.0)``:

    * ``clipnorm=c``: each gradient leaf clipped to norm ``c`` (:func:`norm_clip`);
    * ``clipvalue=v``: each element clipped into ``[-v, v]`` (:func:`value_clip`);
    * ``global_clipnorm=c``: all gradients scaled by one factor to global norm ``c``
      (:func:`global_clip`).

    As in Keras, a value ``<= 0`` turns the clip off (the gradient reaches `optimizer`
    unchanged), also when it is traced (``optax.inject_hyperparams``) or a schedule's value; the
    transformations themselves follow TensorFlow instead (a negative threshold is zero).

    Args:
      optimizer: the ``optax.GradientTransformation`` to wrap (``optax.adam(1e-3)``, not
        ``optax.adam``).
      clipnorm: see above; a 0-d number, traced value or schedule. At most one of the three may
        be given.
      clipvalue: see above; a 0-d number or traced value.
      global_clipnorm: see above; a 0-d number, traced value or schedule.
      nonfinite: what to do when the gradient's global norm is not finite: ``"propagate"``
        (default; NaN reaches the update), ``"zero"`` (the clipped gradient becomes zeros before
        the optimizer sees it), ``"skip"`` (the update is zeros and the optimizer's state is
        left exactly as it was: a skipped step) or ``"raise"`` (:class:`NonFiniteNormError`,
        as PyTorch's ``error_if_nonfinite=True``; see :func:`global_clip`). ``"zero"`` and
        ``"skip"`` count the step in ``skip_count``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`ClippedState`
      (``clip_state``, ``inner_state``, ``skip_count``).

    Raises:
      ValueError: more than one of `clipnorm`, `clipvalue`, `global_clipnorm`; an unknown
        `nonfinite`; a threshold that is not 0-d or is NaN (a traced NaN makes the update NaN).
      TypeError: `optimizer` is not a transformation (say, the factory ``optax.adam`` itself); a
        non-numeric leaf (a str, a NumPy array of objects; at init and update), named by its
        path; an integer or boolean leaf at update with `clipnorm` or `global_clipnorm`.
      NonFiniteNormError: with ``nonfinite="raise"``, a gradient whose norm is not finite.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optclip.clipped(optax.sgd(1.0), global_clipnorm=1.0)
      >>> params = jnp.zeros(2)
      >>> updates, state = opt.update(jnp.array([3., 4.]), opt.init(params), params)
      >>> print(updates, optax.tree.get(state, "global_norm"))
      [-0.6 -0.8] 5.0
    """
    _check_optimizer(optimizer)
    given = [
        name
        for name, value in (
            ("clipnorm", clipnorm),
            ("clipvalue", clipvalue),
            ("global_clipnorm", global_clipnorm),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            "`clipped` takes at most one of `clipnorm`, `clipvalue` and `global_clipnorm`, "
            f"got {', '.join(f'`{g}`' for g in given)}."
        )
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "skip", "raise"))
    if clipnorm is not None:
        clip = norm_clip(_keras_threshold(_checks.check_threshold(clipnorm, "clipnorm")))
    elif clipvalue is not None:
        clip = value_clip(_keras_threshold(_checks.check_scalar(clipvalue, "clipvalue")))
    elif global_clipnorm is not None:
        threshold = _checks.check_threshold(global_clipnorm, "global_clipnorm")
        clip = global_clip(
            _keras_threshold(threshold), nonfinite="raise" if nonfinite == "raise" else "propagate"
        )
    else:
        clip = optax.identity()
    inner = optax.with_extra_args_support(optimizer)

    def init_fn(params):
        _checks.check_leaves(params, "`init`")
        return ClippedState(clip.init(params), inner.init(params), _steps.counter())

    def update_fn(updates, state, params=None, **extra_args):
        _checks.check_leaves(updates, "clipped")
        if nonfinite != "propagate" and global_clipnorm is None:
            norm = _norms.global_norm_of(updates, 2.0, None, "clipped")
            if nonfinite == "raise":
                _nonfinite.raise_if_nonfinite(norm, updates, "clipped")
            finite = jnp.isfinite(norm)
        clip_updates, clip_state = clip.update(updates, state.clip_state, params)
        if nonfinite != "propagate" and global_clipnorm is not None:
            finite = jnp.isfinite(clip_state.global_norm)
        if nonfinite == "zero":
            clip_updates = _nonfinite.zero_unless(finite, clip_updates)
        new_updates, inner_state = inner.update(
            clip_updates, state.inner_state, params, **extra_args
        )
        skip_count = state.skip_count
        if nonfinite == "skip":
            new_updates, inner_state = _nonfinite.skip_unless(
                finite, new_updates, inner_state, state.inner_state
            )
        if nonfinite in ("zero", "skip"):
            skip_count = skip_count + (~finite).astype(jnp.int32)
        return new_updates, ClippedState(clip_state, inner_state, skip_count)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
