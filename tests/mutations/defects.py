"""The planted defects of `plant.py`: each a small exact-text replacement in one file under
``src/optclip/`` (`old` occurs exactly once there), with the current tests most likely to
catch it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Defect:
    """One plausible bug: replace `old` by `new` in `path` (relative to the repository)."""

    name: str
    path: str
    old: str
    new: str
    why: str
    tests: tuple[str, ...]


DEFECTS: list[Defect] = [
    Defect(
        "bf16-accumulation",
        "src/optclip/norms/_reductions.py",
        "    accs = {accum_dtype(d) for d in dtypes}\n",
        "    accs = {accum_dtype(d) for d in dtypes}\n"
        "    if dtypes and all(jnp.dtype(d) == jnp.dtype(jnp.bfloat16) for d in dtypes):\n"
        "        return jnp.dtype(jnp.bfloat16)\n",
        "the norm of bfloat16 leaves accumulated in bfloat16, not float32",
        ("tests/test_norms.py", "tests/test_exactness.py"),
    ),
    Defect(
        "inf-norm-drops-nan",
        "src/optclip/norms/_reductions.py",
        "    return jnp.where(nan_count > 0, jnp.nan, largest)",
        "    return largest",
        "the infinity norm drops a NaN (a vectorised max loses it)",
        (
            "tests/test_norms.py",
            "tests/test_nonfinite_and_axes.py",
            "tests/test_exactness.py",
            "tests/test_transforms.py",
        ),
    ),
    Defect(
        "shard-map-local-norm",
        "src/optclip/norms/_norms.py",
        'vector = lax.psum(vector, axes) if how == "sum" else lax.pmax(vector, axes)',
        'vector = vector if how == "sum" else lax.pmax(vector, axes)',
        "the norm inside shard_map is the local shard's (psum left out)",
        ("tests/test_multidevice.py",),
    ),
    Defect(
        "clip-factor-without-min",
        "src/optclip/norms/_scale.py",
        "    over = norm > threshold\n",
        "    over = norm > 0\n",
        "clip factor c/n without the min(1, .): small gradients are scaled up",
        ("tests/test_functional.py", "tests/test_transforms.py"),
    ),
    Defect(
        "clip-vjp-without-projection",
        "src/optclip/norms/_scale.py",
        "            step = step - unit * along.astype(work)\n",
        "            step = step\n",
        "the clip's derivative without its projection term (the norm's dependence on x lost)",
        ("tests/test_exactness.py",),
    ),
    Defect(
        "value-clip-bounds-swapped",
        "src/optclip/clips/_functional.py",
        "jnp.clip(x, lo, hi)",
        "jnp.clip(x, hi, lo)",
        "clip_by_value with its lower and upper bounds swapped",
        ("tests/test_functional.py", "tests/test_transforms.py"),
    ),
    Defect(
        "leaf-check-wrong-path",
        "src/optclip/_checks.py",
        '    return jax.tree_util.keystr(tuple(path)) or "<array>"',
        '    return jax.tree_util.keystr(tuple(path)[:1]) or "<array>"',
        "a leaf check names only the first key of the leaf's path",
        ("tests/test_checks.py",),
    ),
    Defect(
        "skipped-step-advances-adam",
        "src/optclip/guards/_guarded.py",
        "        ~skip, new_updates, inner_state, state.inner_state\n",
        "        ~skip, new_updates, inner_state, inner_state\n",
        "a skipped step returns zero updates but still advances the optimizer's state",
        ("tests/test_guarded.py",),
    ),
    Defect(
        "no-backoff-in-window",
        "src/optclip/guards/_guarded.py",
        "scaler = _loss_scale.adjust(guards.scaling, state.scaler, finite)",
        "scaler = _loss_scale.adjust(\n"
        "            guards.scaling, state.scaler, finite | (guards.window is not None)\n"
        "        )",
        "the loss scale does not back off after an overflow inside an accumulation window",
        ("tests/test_accumulation.py",),
    ),
    Defect(
        "loss-scale-never-backs-off",
        "src/optclip/guards/_loss_scale.py",
        "jnp.where(finite, jnp.where(grow, grown, scale), backed_off)",
        "jnp.where(finite, jnp.where(grow, grown, scale), scale)",
        "an overflow leaves the dynamic loss scale where it was",
        ("tests/test_guarded.py",),
    ),
    Defect(
        "window-restarts-as-0-times-sum",
        "src/optclip/guards/_accumulate.py",
        "grads=jax.tree.map(jnp.zeros_like, state.grads),",
        "grads=jax.tree.map(lambda g: 0 * g, state.grads),",
        "the accumulation sum restarts as 0 * sum (an overflow's NaN outlives its window)",
        ("tests/test_accumulation.py",),
    ),
    Defect(
        "ghost-tied-cross-term-dropped",
        "src/optclip/per_example/ghost/_norms.py",
        "cross = 2 * _factors.pair_term(x1, y1, x2, y2, acc)",
        "cross = 0 * _factors.pair_term(x1, y1, x2, y2, acc)",
        "the ghost norm of a tied weight leaves out its uses' cross terms (i != j)",
        ("tests/test_ghost.py",),
    ),
    Defect(
        "ghost-shared-gradient-of-a-read-output",
        "src/optclip/per_example/ghost/_shared.py",
        "    while users[v] == 1 and",
        "    while users[v] >= 1 and",
        "a product also read on its own shares the output gradient of the sum it is added to",
        ("tests/test_ghost_recurrent.py",),
    ),
    Defect(
        "ghost-gate-read-from-the-first-slice",
        "src/optclip/per_example/ghost/_shared.py",
        "give(p, Sliced(path.param, start, stop, node))",
        "give(p, Sliced(path.param, 0, stop - start, node))",
        "a product split into gates reads every shared gate's gradient from the first slice",
        ("tests/test_ghost_recurrent.py",),
    ),
    Defect(
        "ghost-zero-threshold-clips-nothing",
        "src/optclip/per_example/ghost/_batch.py",
        "    scale = _scale.clip_scale(norms, threshold)\n",
        "    scale = jnp.where(threshold > 0, _scale.clip_scale(norms, threshold), 1.0)\n",
        "clipped_grad takes a threshold of 0 as no clipping (the sum is not zeros)",
        ("tests/test_ghost.py::test_every_model_method_and_threshold",),
    ),
    Defect(
        "ghost-padding-counted",
        "src/optclip/per_example/ghost/_batch.py",
        "    keep = ~padding & (finite | (not s.nan_safe))",
        "    keep = finite | (not s.nan_safe)",
        "a padding example is counted in clipped_grad's sum",
        ("tests/test_ghost.py::test_padding_examples_contribute_exactly_zero",),
    ),
    Defect(
        "ghost-nonfinite-not-flagged",
        "src/optclip/per_example/ghost/_norms.py",
        "    return jnp.where(flagged, jnp.asarray(jnp.nan, acc), norms)",
        "    return norms",
        "a record or output gradient that is not finite is not flagged (finite norm)",
        ("tests/test_ghost.py",),
    ),
    Defect(
        "ghost-exponent-off-by-one",
        "src/optclip/per_example/ghost/_interpret.py",
        "    up = _factors.power_of_two(2 - shift, x.dtype)",
        "    up = _factors.power_of_two(1 - shift, x.dtype)",
        "`scaled` divides by a power of two one too small (every ghost norm doubled)",
        ("tests/test_ghost.py",),
    ),
    Defect(
        "ghost-eager-stale-program",
        "src/optclip/per_example/ghost/_eager.py",
        "            tuple(map(value_key, statics)),\n",
        "            tuple(map(type, statics)),\n",
        "an eager clipped_grad call's key leaves out the Python values: a stale program runs",
        ("tests/test_ghost_eager.py",),
    ),
    Defect(
        "ghost-normalize-by-ignored",
        "src/optclip/per_example/ghost/_api.py",
        "grads = jax.tree.map(lambda g: g / normalize_by, grads)",
        "grads = jax.tree.map(lambda g: g * 1, grads)",
        "clipped_grad's `normalize_by` is ignored",
        ("tests/test_ghost.py::test_normalize_by_divides_the_clipped_sum",),
    ),
    Defect(
        "per-example-nonfinite-not-zeroed",
        "src/optclip/per_example/_clips.py",
        "        x = jnp.where(keep, x, jnp.zeros((), x.dtype))\n",
        "        x = x\n",
        'nonfinite="zero" zeroes a non-finite example\'s scale but not its values (0 * inf)',
        ("tests/test_per_example.py",),
    ),
    Defect(
        "per-example-counts-nonfinite-as-clipped",
        "src/optclip/per_example/_clips.py",
        "    num_clipped = _count(finite & (norms > threshold))",
        "    num_clipped = _count(norms > threshold)",
        "num_clipped counts an example of infinite norm as clipped",
        ("tests/test_per_example.py",),
    ),
    Defect(
        "adagc-ema-weights-swapped",
        "src/optclip/adaptive/_adagc.py",
        "    ema = beta * gamma + (1 - beta) * clipped",
        "    ema = beta * clipped + (1 - beta) * gamma",
        "AdaGC's EMA of the clipped norms weighs the new norm by beta",
        ("tests/test_adagc.py",),
    ),
    Defect(
        "zclip-spike-reversed",
        "src/optclip/adaptive/_zclip.py",
        "    spike = z > z_thr",
        "    spike = z < z_thr",
        "ZClip's spike test compares the z-score the wrong way",
        ("tests/test_adaptive.py",),
    ),
    Defect(
        "zclip-ema-alpha-swapped",
        "src/optclip/adaptive/_zclip.py",
        "    ema_mean = a * mean + (1 - a) * x",
        "    ema_mean = (1 - a) * mean + a * x",
        "ZClip's EMA of the mean weighs the new norm by alpha",
        ("tests/test_adaptive.py",),
    ),
    Defect(
        "autoclip-percentile-reads-empty-slots",
        "src/optclip/adaptive/_autoclip.py",
        "    valid = jnp.arange(size) < filled\n",
        "    valid = jnp.arange(size) < size\n",
        "AutoClip's percentile counts the history's unfilled (zero) slots",
        ("tests/test_adaptive.py",),
    ),
    Defect(
        "spike-test-reversed",
        "src/optclip/guards/_spikes.py",
        "    spike = norm.astype(dtype) > norm_limit",
        "    spike = norm.astype(dtype) < norm_limit",
        "guarded's spike test skips the steps below the threshold",
        ("tests/test_guarded.py",),
    ),
    Defect(
        "metrics-std-is-variance",
        "src/optclip/_metrics.py",
        '("std", lambda: jnp.sqrt(state.var))',
        '("std", lambda: state.var)',
        "metrics reports ZClip's variance as its std",
        ("tests/test_metrics.py",),
    ),
]
