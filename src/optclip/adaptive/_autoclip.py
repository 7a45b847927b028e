"""AutoClip (Seetharaman et al. 2020): a global clip at a percentile of the recent norms."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip import _checks
from optclip.clips import _nonfinite, _steps
from optclip.norms import _axes, _groups
from optclip.norms._groups import GroupNorms


class AutoClipState(NamedTuple):
    """State of :func:`autoclip`."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    threshold: jax.Array  # the percentile used for the last update (inf before the first)
    norms: jax.Array  # ring buffer of the last `history` finite norms, shape (history,)
    filled: jax.Array  # how many entries of `norms` are valid (<= history)
    next_index: jax.Array  # where the next norm is written
    clip_count: jax.Array  # updates so far that were scaled down
    nonfinite_count: jax.Array  # updates so far whose norm was not finite (not recorded)
    scale: jax.Array  # factor the last update was multiplied by
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


def _percentile(values, filled, q):
    """NumPy's ``percentile(values[:filled], q)`` ('linear' method), traceable; inf if empty.

    Invalid entries are sorted to the end as +inf, and only indices below `filled` are read.
    """
    size = values.shape[0]
    valid = jnp.arange(size) < filled
    ordered = jnp.sort(jnp.where(valid, values, jnp.inf))
    position = (
        _steps.as_dtype(q, values.dtype) / 100 * (jnp.maximum(filled, 1) - 1).astype(values.dtype)
    )
    position = jnp.clip(position, 0, jnp.maximum(filled - 1, 0).astype(values.dtype))
    low = jnp.floor(position).astype(jnp.int32)
    high = jnp.minimum(low + 1, jnp.maximum(filled - 1, 0))
    below, above = ordered[low], ordered[high]
    t = position - low.astype(values.dtype)
    # NumPy's lerp: from the nearer end, so that t == 1 gives `above` exactly.
    diff = above - below
    result = jnp.where(t >= 0.5, above - diff * (1 - t), below + diff * t)
    result = jnp.where(low == high, below, result)
    return jnp.where(filled > 0, result, jnp.inf)


@_checks.factory
def autoclip(
    percentile=10.0,
    history=1000,
    *,
    axis_name=None,
    nonfinite="propagate",
    group_norms=None,
    stacked=None,
) -> optax.GradientTransformation:
    r"""AutoClip: a global clip at a percentile of the recent gradient norms.

    .. math::
        c_t = P_p\big(\{\|g_s\|_2 : t - H < s \le t\}\big), \qquad
        g_t \mapsto g_t \cdot \frac{c_t}{\max(\|g_t\|_2, c_t)}

    :math:`P_p` is the `percentile` :math:`p` with linear interpolation (NumPy's default
    ``'linear'`` method) over the last :math:`H` = `history` global norms, the current one
    included: before :math:`H` steps, over all of them. The paper keeps the whole history; a
    finite window lets the threshold follow a changing scale and keeps the state fixed-size.

    A non-finite norm is not recorded (the history is never poisoned) and is counted in
    ``nonfinite_count``; that update is NaN (`nonfinite="propagate"`) or zeros (``"zero"``).

    Args:
      percentile: :math:`p` in [0, 100] (default 10: the paper's best value for audio source
        separation; higher values clip less). May be traced (``optax.inject_hyperparams``).
      history: :math:`H`, how many recent norms are kept, an int >= 1. It sets the state's shape,
        so it is static: with ``optax.inject_hyperparams`` pass ``static_args=("history",)``.
      axis_name: mesh axes the updates are split over inside ``shard_map``/``pmap``; see
        :func:`optclip.global_norm`.
      nonfinite: ``"propagate"`` (default), ``"zero"`` or ``"raise"``, as in
        :func:`optclip.global_clip`.
      group_norms: also keep the pre-clip norm of groups of leaves in the state, as in
        :func:`optclip.global_clip`.
      stacked: the subtrees whose leaves stack layers (per-layer norms), as in
        :func:`optclip.global_clip`.

    Returns:
      An ``optax.GradientTransformation`` whose state is an :class:`AutoClipState`:
      ``global_norm`` (pre-clip norm of the last update), ``threshold`` (the percentile it was
      clipped to), ``norms`` (shape ``(history,)``), ``filled``, ``next_index``,
      ``clip_count``, ``nonfinite_count``, ``scale`` (the factor applied) and ``group_norms``.

    Raises:
      ValueError: `percentile` outside [0, 100] or not 0-d; `history` not an int >= 1; unknown
        `nonfinite`; a `group_norms` or `stacked` that does not fit (as in
        :func:`optclip.global_clip`).
      TypeError: `history` is a JAX array (traced by ``inject_hyperparams``); `axis_name` is not
        one of the accepted forms; a non-numeric leaf (a str, a NumPy array of objects; at init
        and update), an integer or boolean leaf (at update), each named by its path.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.autoclip(percentile=50.0, history=3)
      >>> state = tx.init(jnp.zeros(2))
      >>> for g in ([3., 4.], [0., 1.], [0., 2.], [0., 10.]):
      ...     u, state = tx.update(jnp.array(g), state)
      >>> print(u, optax.tree.get(state, "threshold"))  # median of the norms 1, 2, 10
      [0. 2.] 2.0

    References:
      Seetharaman et al., 2020, AutoClip: Adaptive Gradient Clipping for Source Separation
      Networks, https://arxiv.org/abs/2007.14469
    """
    _checks.check_number(percentile, "percentile", "a number in [0, 100]", lambda v: 0 <= v <= 100)
    _checks.check_count(history, "history", static=True)
    _axes.check_axis_name(axis_name)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "raise"))
    group_norms = _groups.check_spec(group_norms)
    stacked = _groups.check_stacked(stacked, group_norms)
    size = int(history)

    def init_fn(params):
        dtype = _steps.state_dtype(params)
        return AutoClipState(
            global_norm=jnp.zeros((), dtype),
            threshold=jnp.full((), jnp.inf, dtype),
            norms=jnp.zeros((size,), dtype),
            filled=_steps.counter(),
            next_index=_steps.counter(),
            clip_count=_steps.counter(),
            nonfinite_count=_steps.counter(),
            scale=jnp.ones((), dtype),
            group_norms=_groups.init(group_norms, params, dtype, stacked, axis_name, "autoclip"),
        )

    def step(updates, state, inverse_scale=None):
        dtype = state.norms.dtype
        norm, bucket_norms = _steps.clip_norms(
            updates, state.group_norms, group_norms, stacked, axis_name, "autoclip", inverse_scale
        )
        norm = norm.astype(dtype)
        finite = jnp.isfinite(norm)
        norms = jnp.where(finite, state.norms.at[state.next_index].set(norm), state.norms)
        filled = jnp.where(finite, jnp.minimum(state.filled + 1, size), state.filled)
        next_index = jnp.where(finite, (state.next_index + 1) % size, state.next_index)
        threshold = _percentile(norms, filled, percentile)
        updates, scale = _nonfinite.clip_to_threshold(
            updates, norm, threshold, nonfinite, "autoclip", inverse_scale
        )
        new_state = AutoClipState(
            global_norm=norm,
            threshold=threshold,
            norms=norms,
            filled=filled.astype(jnp.int32),
            next_index=next_index.astype(jnp.int32),
            clip_count=state.clip_count + (finite & (norm > threshold)).astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            scale=scale.astype(dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return updates, new_state

    return _steps.global_norm_transform(init_fn, step)
