"""ZClip (Kumar et al. 2025): a global clip when the norm is an outlier against its EMA mean and
variance."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip import _checks, _warn
from optclip.clips import _nonfinite, _steps
from optclip.norms import _axes, _groups, _scale
from optclip.norms._groups import GroupNorms


class ZClipState(NamedTuple):
    """State of :func:`zclip`."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    threshold: jax.Array  # largest norm the last update could have had and passed unchanged
    mean: jax.Array  # EMA of the norm (during warm-up: mean of the norms so far)
    var: jax.Array  # EMA of its variance (during warm-up: population variance so far)
    finite_count: jax.Array  # finite norms so far (warm-up ends when it reaches `warmup_steps`)
    spike_count: jax.Array  # updates after warm-up flagged as spikes
    nonfinite_count: jax.Array  # updates so far whose norm was not finite (not recorded)
    scale: jax.Array  # factor the last update was multiplied by
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


class _Rule(NamedTuple):
    """ZClip's settings that decide a spike, its clip value and the statistics' update."""

    alpha: object
    z_thresh: object
    mode: str
    clip_option: str
    clip_factor: object
    skip_update_on_spike: bool
    eps: object


def _spike(state, norm, rule: _Rule, dtype):
    """``(spike, clip value, boundary)`` from the statistics before this step: the reference's
    `_compute_clip_val` (the boundary is the largest norm that is not a spike)."""
    mean, std = state.mean, jnp.sqrt(state.var)
    z_thr = _steps.as_dtype(rule.z_thresh, dtype)
    if rule.mode == "percentile":
        boundary = mean + z_thr * std
        return norm > boundary, boundary, boundary
    eps = _steps.as_dtype(rule.eps, dtype)
    z = (norm - mean) / (std + eps)
    spike = z > z_thr
    boundary = mean + z_thr * (std + eps)
    if rule.clip_option == "mean":
        return spike, mean, boundary
    eta = jnp.where(spike, z, z_thr) / z_thr  # >= 1: finite where not a spike
    clip_value = (mean + z_thr * std / eta) * _steps.as_dtype(rule.clip_factor, dtype)
    return spike, clip_value, boundary


def _statistics(state, norm, spike, clip_value, warming, rule: _Rule, dtype):
    """The mean and variance after this step: Welford's running mean and population variance
    during warm-up (equal to the reference's buffer), then the EMA fed with the clip value on a
    spike (the variance with the already-updated mean), or left alone on a spike with
    `skip_update_on_spike`."""
    mean, var = state.mean, state.var
    k = (state.finite_count + 1).astype(dtype)
    delta = norm - mean
    warm_mean = mean + delta / k
    warm_var = var + (delta * (norm - warm_mean) - var) / k
    a = _steps.as_dtype(rule.alpha, dtype)
    x = jnp.where(spike, clip_value, norm)
    ema_mean = a * mean + (1 - a) * x
    ema_var = a * var + (1 - a) * jnp.square(x - ema_mean)
    if rule.skip_update_on_spike:
        ema_mean = jnp.where(spike, mean, ema_mean)
        ema_var = jnp.where(spike, var, ema_var)
    return jnp.where(warming, warm_mean, ema_mean), jnp.where(warming, warm_var, ema_var)


@_checks.factory
def zclip(
    alpha=0.97,
    z_thresh=2.5,
    max_norm=1.0,
    warmup_steps=25,
    mode="zscore",
    clip_option="adaptive_scaling",
    clip_factor=1.0,
    skip_update_on_spike=False,
    *,
    eps=1e-6,
    axis_name=None,
    nonfinite="propagate",
    group_norms=None,
    stacked=None,
) -> optax.GradientTransformation:
    r"""ZClip: a global clip when the norm is an outlier against its EMA mean and variance.

    After warm-up, with :math:`\mu, \sigma^2` the EMA statistics before step :math:`t` and
    :math:`n_t = \|g_t\|_2`:

    .. math::
        z_t = \frac{n_t - \mu}{\sigma + \epsilon}, \qquad
        \text{spike} \iff z_t > z_{thr}

    On a spike the norm is clipped to :math:`c_t`: ``mode="zscore"`` with
    ``clip_option="adaptive_scaling"``: :math:`c_t = (\mu + z_{thr}^2\,\sigma / z_t)\cdot`
    `clip_factor` (:math:`\mu + z_{thr}\sigma/\eta` with :math:`\eta = z_t/z_{thr}`: larger
    outliers are clipped harder); ``clip_option="mean"``: :math:`c_t = \mu`; ``mode="percentile"``
    (spike when :math:`n_t > \mu + z_{thr}\sigma`): :math:`c_t = \mu + z_{thr}\sigma`. Then the
    update is scaled to :math:`\min(c_t, \text{max\_norm})` (or to `max_norm` without a spike),
    and the statistics are updated, the variance with the already-updated mean, from
    :math:`x = c_t` on a spike (not the raw norm) and :math:`x = n_t` otherwise:

    .. math::
        \mu \leftarrow \alpha\mu + (1-\alpha)x, \qquad
        \sigma^2 \leftarrow \alpha\sigma^2 + (1-\alpha)(x - \mu)^2

    With `skip_update_on_spike`, a spike leaves the statistics unchanged. During the first
    `warmup_steps` finite norms the update is only clipped to `max_norm`, and then :math:`\mu`,
    :math:`\sigma^2` start as the mean and population variance of those norms. These are the
    rules and order of the reference implementation (``bluorion-com/ZClip``, ``zclip.py``), with
    two differences on purpose: the scale is ``c / n`` exactly (the reference divides by
    ``n + 1e-6``), and a non-finite norm changes no statistic and does not count towards the
    warm-up (the reference would poison its EMA); that update is NaN (`nonfinite="propagate"`)
    or zeros (``"zero"``) and is counted in ``nonfinite_count``.

    Args:
      alpha: EMA smoothing :math:`\alpha` in (0, 1) (default 0.97).
      z_thresh: :math:`z_{thr} > 0` (default 2.5).
      max_norm: an absolute cap on the norm, applied at every step, warm-up included (default
        1.0, as in the reference); ``None`` turns it off. Negative values mean zero. May be an
        Optax schedule of the step count (every update counts, non-finite ones included).
      warmup_steps: how many finite norms initialise the statistics, an int >= 1 (default 25).
      mode: ``"zscore"`` (default) or ``"percentile"``.
      clip_option: with ``mode="zscore"``: ``"adaptive_scaling"`` (default) or ``"mean"``;
        ignored with ``mode="percentile"``.
      clip_factor: multiplies the ``"adaptive_scaling"`` threshold, > 0 (default 1.0; the
        reference suggests 0.5-0.9 for more aggressive clipping).
      skip_update_on_spike: if True, spikes do not update the statistics (default False).
      eps: :math:`\epsilon > 0` in the z-score's denominator (default 1e-6, as in the reference).
      axis_name: mesh axes the updates are split over inside ``shard_map``/``pmap``; see
        :func:`optclip.global_norm`.
      nonfinite: ``"propagate"`` (default), ``"zero"`` or ``"raise"``, as in
        :func:`optclip.global_clip`.
      group_norms: also keep the pre-clip norm of groups of leaves in the state, as in
        :func:`optclip.global_clip`.
      stacked: the subtrees whose leaves stack layers (per-layer norms), as in
        :func:`optclip.global_clip`.

    Every numeric argument may be traced (``optax.inject_hyperparams``); the state's shape does
    not depend on any of them.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`ZClipState`: ``global_norm``
      (pre-clip norm of the last update); ``threshold``, the largest norm the last update could
      have had and passed unchanged (`max_norm` or inf during warm-up, then the spike boundary
      :math:`\mu + z_{thr}(\sigma + \epsilon)`, or :math:`\mu + z_{thr}\sigma` in percentile
      mode, capped at `max_norm`); ``mean``, ``var``, ``finite_count``, ``spike_count``,
      ``nonfinite_count``, ``scale`` (the factor applied) and ``group_norms``.

    Raises:
      ValueError: `alpha` outside (0, 1); `z_thresh`, `clip_factor` or `eps` not > 0;
        `warmup_steps` not an int >= 1; unknown `mode`, `clip_option` or `nonfinite`; a number
        that is not 0-d; a `group_norms` or `stacked` that does not fit (as in
        :func:`optclip.global_clip`).
      TypeError: `skip_update_on_spike` not a bool; `axis_name` not one of the accepted forms;
        a non-numeric leaf (a str, a NumPy array of objects; at init and update), an integer or
        boolean leaf (at update), each named by its path.

    Warns:
      UserWarning: a concrete `max_norm` <= 0, which zeroes every update (``max_norm=None``
        turns the absolute cap off).

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.zclip(warmup_steps=3, max_norm=None)
      >>> state = tx.init(jnp.zeros(1))
      >>> for g in (1.0, 1.2, 0.8, 1.1, 5.0):
      ...     u, state = tx.update(jnp.array([g]), state)
      >>> print(round(float(u[0]), 4), optax.tree.get(state, "spike_count"))  # 5.0 was a spike
      1.0439 1

    References:
      Kumar et al., 2025, ZClip: Adaptive Spike Mitigation for LLM Pre-Training,
      https://arxiv.org/abs/2504.02507 (reference implementation:
      https://github.com/bluorion-com/ZClip)
    """
    _checks.check_number(alpha, "alpha", "a number in (0, 1)", lambda v: 0 < v < 1)
    _checks.check_number(z_thresh, "z_thresh", "a number > 0", lambda v: v > 0)
    if max_norm is not None:
        _checks.check_threshold(max_norm, "max_norm")
        _warn.warn_if_nonpositive(
            max_norm,
            f"zclip(max_norm={max_norm!r})",
            "If you meant no absolute cap, pass `max_norm=None`.",
        )
    _checks.check_count(warmup_steps, "warmup_steps", static=False)
    _checks.check_choice(mode, "mode", ("zscore", "percentile"))
    if mode == "zscore":
        _checks.check_choice(clip_option, "clip_option", ("adaptive_scaling", "mean"))
    _checks.check_number(clip_factor, "clip_factor", "a number > 0", lambda v: v > 0)
    _checks.check_bool(skip_update_on_spike, "skip_update_on_spike")
    _checks.check_number(eps, "eps", "a number > 0", lambda v: v > 0)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "raise"))
    _axes.check_axis_name(axis_name)
    group_norms = _groups.check_spec(group_norms)
    stacked = _groups.check_stacked(stacked, group_norms)
    rule = _Rule(alpha, z_thresh, mode, clip_option, clip_factor, skip_update_on_spike, eps)

    def cap_at(step, dtype):
        """The absolute cap at `step` (`max_norm`, its schedule's value, or inf)."""
        cap = jnp.inf if max_norm is None else _steps.threshold_at(max_norm, step)
        return _scale.threshold_as(cap, dtype)

    def init_fn(params):
        dtype = _steps.state_dtype(params)
        return ZClipState(
            global_norm=jnp.zeros((), dtype),
            threshold=cap_at(_steps.counter(), dtype),
            mean=jnp.zeros((), dtype),
            var=jnp.zeros((), dtype),
            finite_count=_steps.counter(),
            spike_count=_steps.counter(),
            nonfinite_count=_steps.counter(),
            scale=jnp.ones((), dtype),
            group_norms=_groups.init(group_norms, params, dtype, stacked, axis_name, "zclip"),
        )

    def step(updates, state, inverse_scale=None):
        dtype = state.mean.dtype
        norm, bucket_norms = _steps.clip_norms(
            updates, state.group_norms, group_norms, stacked, axis_name, "zclip", inverse_scale
        )
        norm = norm.astype(dtype)
        finite = jnp.isfinite(norm)
        # Steps so far: every update is counted in exactly one of the two.
        cap = cap_at(state.finite_count + state.nonfinite_count, dtype)
        warming = state.finite_count < warmup_steps
        spike, clip_value, boundary = _spike(state, norm, rule, dtype)
        spike = spike & ~warming & finite
        target = jnp.where(warming, cap, jnp.minimum(jnp.where(spike, clip_value, norm), cap))
        mean, var = _statistics(state, norm, spike, clip_value, warming, rule, dtype)
        updates, scale = _nonfinite.clip_to_threshold(
            updates, norm, target, nonfinite, "zclip", inverse_scale
        )
        new_state = ZClipState(
            global_norm=norm,
            threshold=jnp.where(warming, cap, jnp.minimum(boundary, cap)),
            mean=jnp.where(finite, mean, state.mean),
            var=jnp.where(finite, var, state.var),
            finite_count=state.finite_count + finite.astype(jnp.int32),
            spike_count=state.spike_count + spike.astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            scale=scale.astype(dtype),
            group_norms=_groups.update(state.group_norms, bucket_norms),
        )
        return updates, new_state

    return _steps.global_norm_transform(init_fn, step)
