"""AdaGC (Wang et al. 2025): each tensor clipped against an EMA of its own clipped norms, after a
warm-up of global clipping."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optclip import _checks
from optclip.clips import _nonfinite, _steps
from optclip.norms import _groups, _norms, _scale
from optclip.norms._groups import GroupNorms


class AdaGCState(NamedTuple):
    """State of :func:`adagc`; the per-leaf fields are :class:`optclip.GroupNorms` keyed by the
    leaves' paths (``state.gamma["dense/kernel"]``)."""

    global_norm: jax.Array  # pre-clip global norm of the last update
    threshold: jax.Array  # max_norm during warm-up, then the global norm of the leaf thresholds
    scale: jax.Array  # norm of the clipped update / norm of the update (1 if nothing was clipped)
    gamma: GroupNorms  # per leaf: EMA of its clipped norms (inf until its first nonzero norm)
    leaf_thresholds: GroupNorms  # per leaf: the last update's threshold (inf during warm-up)
    leaf_clip_counts: GroupNorms  # per leaf: updates after warm-up that scaled it down (int32)
    clip_count: jax.Array  # updates so far in which any leaf was scaled down
    finite_count: jax.Array  # finite updates so far (warm-up ends when it reaches `warmup_steps`)
    nonfinite_count: jax.Array  # updates so far whose norm was not finite (they change no state)
    group_norms: GroupNorms | None  # pre-clip norm of each group (`group_norms=`), else None


class _Rule(NamedTuple):
    lambda_rel: object
    beta: object


def _leaf_scales(gamma, leaf_norms, norm, cap, warming, finite, rule: _Rule):
    """``(scales, thresholds, clipped norms)`` of the leaves: during warm-up one global clip at
    `cap` (thresholds inf), then each leaf clipped at ``lambda_rel * gamma``; NaN scales for a
    non-finite `norm`.

    The scales are `_scale.clip_scale`'s, bit for bit, written as one division at the end:
    XLA does not copy a division into the loops that multiply the leaves by their scale, while
    the selects that `clip_scale` ends with were recomputed there for every element.
    """
    dtype = leaf_norms.dtype
    thresholds = _steps.as_dtype(rule.lambda_rel, dtype) * gamma
    limit = jnp.where(warming, cap, thresholds)  # (broadcast: one per leaf)
    value = jnp.where(warming, norm, leaf_norms)
    over = value > limit
    valid = finite & ~jnp.isnan(limit)
    scales = jnp.where(valid, jnp.where(over, limit, 1), jnp.nan) / jnp.where(over, value, 1)
    clipped = jnp.where(
        warming, leaf_norms * _scale.clip_scale(norm, cap), jnp.minimum(leaf_norms, thresholds)
    )
    return scales, jnp.where(warming, jnp.inf, thresholds), clipped


def _next_gamma(gamma, clipped, warming, rule: _Rule):
    """Each leaf's gamma after this step: during warm-up the smallest nonzero clipped norm so
    far; then ``beta * gamma + (1 - beta) * clipped``, or the clipped norm itself while gamma
    is still unset (inf: the leaf has had no nonzero norm yet)."""
    seen = clipped > 0
    warm = jnp.where(seen, jnp.minimum(gamma, clipped), gamma)
    beta = _steps.as_dtype(rule.beta, gamma.dtype)
    ema = beta * gamma + (1 - beta) * clipped
    unset = jnp.isinf(gamma)
    return jnp.where(warming, warm, jnp.where(unset, jnp.where(seen, clipped, gamma), ema))


def _group_norms(spec, updates, field, leaf_norms):
    """The `group_norms` field from the leaf norms (their root sum of squares by group: no second
    pass over the updates)."""
    if spec is None:
        return None
    buckets = _groups.buckets(spec, updates, field, "adagc")
    leaves = [leaf_norms[i] for i in range(leaf_norms.shape[0])]
    _, bucket_norms = _norms.tree_norms(leaves, [()] * len(leaves), 2.0, buckets)
    return _groups.update(field, bucket_norms)


def _leaf_field(names, values) -> GroupNorms:
    return GroupNorms(names, values)


@_checks.factory
def adagc(
    max_norm=1.0,
    lambda_rel=1.05,
    beta=0.98,
    warmup_steps=100,
    *,
    axis_name=None,
    nonfinite="propagate",
    group_norms=None,
) -> optax.GradientTransformation:
    r"""AdaGC: each tensor clipped against an EMA of its own clipped norms.

    For the first `warmup_steps` finite updates, a global clip at :math:`\lambda_{abs}` =
    `max_norm`, and each leaf :math:`i` records the smallest nonzero norm it has had after
    clipping:

    .. math::
        \hat g_{t,i} = g_{t,i} \min\Big(1, \frac{\lambda_{abs}}{\|g_t\|_2}\Big), \qquad
        \gamma_i \leftarrow \min(\gamma_i, \|\hat g_{t,i}\|_2)

    Then every leaf is clipped on its own, against :math:`\lambda_{rel}` times its
    :math:`\gamma_i`, which follows an exponential moving average of its clipped norms:

    .. math::
        \hat g_{t,i} = g_{t,i} \min\Big(1, \frac{\lambda_{rel}\,\gamma_i}
        {\|g_{t,i}\|_2}\Big), \qquad
        \gamma_i \leftarrow \beta\,\gamma_i + (1-\beta)\,\|\hat g_{t,i}\|_2

    A tensor is one leaf of the update tree (a whole kernel or bias; split over devices, its norm
    is over the whole tensor). Chain it before any optimizer: ``optax.chain(optclip.adagc(),
    optax.adamw(...))`` is the paper's AdamW with AdaGC. No TensorFlow counterpart.

    These are the rules of the paper and of its authors' code (a Megatron-LM patch, class
    ``AdaGC``: ``steps <= start_clip_steps`` warm-up steps), and of pytorch-optimizer's
    ``AdaGC`` optimizer, whose ``warmup_steps=W`` runs ``W - 1`` warm-up steps (its test is
    ``step < W``): ``adagc(warmup_steps=W - 1)`` gives its clipped gradients. Differences on
    purpose: the scale is exactly :math:`t/n` (no ``eps`` added to the norm: the clipped norm is
    the threshold); a zero norm during warm-up leaves :math:`\gamma_i` alone (the references
    set :math:`\gamma_i = 0`, and that tensor is then clipped to zero, or to ~1e-8, at every
    later step: a tensor whose first gradients are zero, such as LoRA's ``A`` while ``B = 0``,
    would never train), and a leaf with no nonzero norm by the end of warm-up takes its first
    nonzero norm as :math:`\gamma_i` (as the authors' code does for a tensor it has not seen);
    a non-finite update changes no state and does not count towards the warm-up (the
    references would make :math:`\gamma` NaN for good); norms are accumulated in float32 for
    float16 and bfloat16 leaves.

    Args:
      max_norm: :math:`\lambda_{abs}`, the global threshold during warm-up: a 0-d number
        (negative means zero), a traced value or an Optax schedule of the step count (every
        update counts, non-finite ones included). Default 1.0.
      lambda_rel: :math:`\lambda_{rel} > 0`, how far above its own EMA a leaf's norm may go
        (default 1.05, as pytorch-optimizer's; the authors' GPT-2 script uses 1.04).
      beta: :math:`\beta` in [0, 1), the EMA's smoothing (default 0.98, as pytorch-optimizer's;
        the authors' script uses 0.99).
      warmup_steps: how many finite updates are clipped globally first, an int >= 1 (default
        100).
      axis_name: mesh axes the updates are split over inside ``shard_map``/``pmap``; see
        :func:`optclip.global_norm`. Every leaf's norm is then the whole tensor's.
      nonfinite: ``"propagate"`` (default), ``"zero"`` or ``"raise"``, as in
        :func:`optclip.global_clip`.
      group_norms: also keep the pre-clip norm of groups of leaves in the state, as in
        :func:`optclip.global_clip` (from the leaf norms: no second pass).

    Every numeric argument may be traced (``optax.inject_hyperparams``); the state's shape does
    not depend on any of them.

    Returns:
      An ``optax.GradientTransformation`` whose state is an :class:`AdaGCState`:
      ``global_norm`` (pre-clip); ``threshold`` (`max_norm` during warm-up, then the global norm
      of the leaf thresholds, which bounds the clipped update's norm); ``scale`` (the clipped
      update's norm over the update's); per leaf, as :class:`optclip.GroupNorms` keyed by path:
      ``gamma``, ``leaf_thresholds`` (:math:`\lambda_{rel}\gamma_i` the last update was clipped
      at; inf during warm-up) and ``leaf_clip_counts``; ``clip_count`` (updates in which any
      leaf was scaled down), ``finite_count``, ``nonfinite_count`` and ``group_norms``.

    Raises:
      ValueError: `lambda_rel` not > 0; `beta` outside [0, 1); `warmup_steps` not an int >= 1;
        `max_norm` not 0-d or NaN; unknown `nonfinite` or `group_norms`; at update, updates
        whose leaves are not those the state was made for.
      TypeError: a non-numeric leaf (a str, a NumPy array of objects; at init and update), an
        integer or boolean leaf (at update), each named by its path.
      NonFiniteNormError: with ``nonfinite="raise"``, a non-finite norm.

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> tx = optclip.adagc(max_norm=10.0, lambda_rel=2.0, warmup_steps=2)
      >>> state = tx.init({"a": jnp.zeros(2), "b": jnp.zeros(1)})
      >>> for a in ([3., 4.], [3., 4.], [24., 32.]):  # "a" jumps eightfold at the third step
      ...     u, state = tx.update({"a": jnp.array(a), "b": jnp.array([1.])}, state)
      >>> print(u["a"], u["b"])  # "a" clipped to 2 x its EMA (5); "b" passed unchanged
      [6. 8.] [1.]
      >>> print(state.gamma["a"], state.leaf_clip_counts["a"], state.leaf_clip_counts["b"])
      5.1 1 0

    References:
      Wang et al., 2025, AdaGC: Improving Training Stability for Large Language Model
      Pretraining, https://arxiv.org/abs/2502.11034
    """
    _checks.check_threshold(max_norm, "max_norm")
    _checks.check_number(lambda_rel, "lambda_rel", "a number > 0", lambda v: v > 0)
    _checks.check_number(beta, "beta", "a number in [0, 1)", lambda v: 0 <= v < 1)
    _checks.check_count(warmup_steps, "warmup_steps", static=False)
    _checks.check_choice(nonfinite, "nonfinite", ("propagate", "zero", "raise"))
    group_norms = _groups.check_spec(group_norms)
    rule = _Rule(lambda_rel, beta)

    def cap_at(step, dtype):
        return _scale.threshold_as(_steps.threshold_at(max_norm, step), dtype)

    def init_fn(params):
        dtype = _steps.state_dtype(params)
        names = _groups.init("leaf", params, dtype).names
        n = len(names)
        return AdaGCState(
            global_norm=jnp.zeros((), dtype),
            threshold=cap_at(_steps.counter(), dtype),
            scale=jnp.ones((), dtype),
            gamma=_leaf_field(names, jnp.full((n,), jnp.inf, dtype)),
            leaf_thresholds=_leaf_field(names, jnp.full((n,), jnp.inf, dtype)),
            leaf_clip_counts=_leaf_field(names, jnp.zeros((n,), jnp.int32)),
            clip_count=_steps.counter(),
            finite_count=_steps.counter(),
            nonfinite_count=_steps.counter(),
            group_norms=_groups.init(group_norms, params, dtype),
        )

    def step(updates, state, inverse_scale=None):
        gamma = state.gamma.values
        dtype, n = gamma.dtype, gamma.shape[0]
        buckets = _groups.buckets("leaf", updates, state.gamma, "adagc")
        norm, leaf_norms = _norms.norms_of(updates, 2.0, axis_name, "adagc", buckets)
        if inverse_scale is not None:  # loss-scaled gradients (`guarded`): the unscaled norms
            norm, leaf_norms = _steps.unscale_norms(norm, leaf_norms, inverse_scale)
        norm, leaf_norms = norm.astype(dtype), leaf_norms[:n].astype(dtype)
        finite = jnp.isfinite(norm)
        if nonfinite == "raise":
            _nonfinite.raise_if_nonfinite(norm, updates, "adagc")
        cap = cap_at(state.finite_count + state.nonfinite_count, dtype)
        warming = state.finite_count < warmup_steps
        scales, thresholds, clipped = _leaf_scales(
            gamma, leaf_norms, norm, cap, warming, finite, rule
        )
        leaves, treedef = jax.tree.flatten(updates)
        factors = scales if inverse_scale is None else scales * inverse_scale.astype(dtype)
        out = [_scale.apply_scale(g, factors[i]) for i, g in enumerate(leaves)]
        out_norm = _norms.tree_norm([clipped], [()], 2.0).astype(dtype)
        scale = jnp.where(norm > 0, out_norm / jnp.where(norm > 0, norm, 1), 1)
        scale = jnp.where(finite, scale, jnp.nan)
        if nonfinite == "zero":
            out = _nonfinite.zero_unless(finite, out)
            scale = jnp.where(finite, scale, 0)
        new_gamma = jnp.where(finite, _next_gamma(gamma, clipped, warming, rule), gamma)
        leaf_clipped = finite & (scales < 1)
        names = state.gamma.names
        new_state = AdaGCState(
            global_norm=norm,
            threshold=jnp.where(warming, cap, _norms.tree_norm([thresholds], [()], 2.0)),
            scale=scale.astype(dtype),
            gamma=_leaf_field(names, new_gamma),
            leaf_thresholds=_leaf_field(names, thresholds),
            leaf_clip_counts=_leaf_field(
                names, state.leaf_clip_counts.values + (leaf_clipped & ~warming).astype(jnp.int32)
            ),
            clip_count=state.clip_count + jnp.any(leaf_clipped).astype(jnp.int32),
            finite_count=state.finite_count + finite.astype(jnp.int32),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
            group_norms=_group_norms(group_norms, updates, state.group_norms, leaf_norms),
        )
        return jax.tree.unflatten(treedef, out), new_state

    # (`guarded` folds a loss scale into the norms and the one factor per leaf: no extra pass)
    return _steps.global_norm_transform(init_fn, step)
