"""The loss-scaling section: the guarded step (dynamic loss scale folded into the clip, skipped
steps, spike test) against the same clip without it, and against jmp + optax.

jmp (``pip install jmp``, the ``bench`` extra) is imported here only: it is what JAX users
stack around ``optax.clip_by_global_norm`` today (``DynamicLossScale``: unscale, check
finite, clip, select), and optclip does not depend on it.
"""

from __future__ import annotations

from typing import Any

import _passes
import _timing
import jax
import jax.numpy as jnp
import optax


def _jmp_step(jmp, tx):
    """jmp + optax: the sequence of jmp's README (its loss scale carried as two arrays: jmp's
    pytree class cannot be a jitted argument in current JAX)."""

    def step(grads, state):
        opt_state, scale, counter = state
        loss_scale = jmp.DynamicLossScale(scale, counter)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = tx.update(grads, opt_state)
        loss_scale = loss_scale.adjust(finite)
        new_opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
        updates = jmp.select_tree(finite, updates, jax.tree.map(jnp.zeros_like, updates))
        return updates, (new_opt_state, loss_scale.loss_scale, loss_scale.counter)

    return step


def _jmp_multisteps_step(jmp, tx):
    """jmp + ``optax.MultiSteps``: each micro-batch unscaled and checked by jmp, and dropped (its
    accumulator update undone) where it overflowed, as jmp's README selects the state."""
    return _jmp_step(jmp, optax.MultiSteps(tx, every_k_schedule=WINDOW).gradient_transformation())


WINDOW = 4  # micro-batches in the accumulation contenders' window: each call runs a window


def windowed(step):
    """A step over a whole window: `WINDOW` micro-batches (the same gradients) in one call."""

    def window(grads, state):
        for _ in range(WINDOW):
            updates, state = step(grads, state)
        return updates, state

    return window


def contenders(grads) -> dict[str, tuple[Any, Any]]:
    """``name -> (jitted step(grads, state) -> (updates, state), initial state)``."""
    import jmp

    import optclip

    adam = optax.adam(1e-3)
    steps = {
        "optclip, loss scaling": optclip.guarded(
            adam, clip=optclip.global_clip(1.0), loss_scale=True
        ),
        "optclip, loss scaling + spikes": optclip.guarded(
            adam, clip=optclip.global_clip(1.0), loss_scale=True, skip_spikes=True
        ),
        "optclip, skipped steps only": optclip.guarded(adam, clip=optclip.global_clip(1.0)),
        "optclip, clip alone": optax.chain(optclip.global_clip(1.0), adam),
    }
    out = {
        name: (lambda g, s, o=opt: o.update(g, s), opt.init(grads)) for name, opt in steps.items()
    }
    tx = optax.chain(optax.clip_by_global_norm(1.0), adam)
    state = (tx.init(grads), jnp.float32(2.0**16), jnp.int32(0))
    out["jmp + optax"] = (_jmp_step(jmp, tx), state)
    accumulating = optclip.guarded(
        adam, clip=optclip.global_clip(1.0), loss_scale=True, accumulation_steps=WINDOW
    )
    out["optclip, accumulation window"] = (
        windowed(lambda g, s: accumulating.update(g, s)),
        accumulating.init(grads),
    )
    multi = optax.MultiSteps(tx, every_k_schedule=WINDOW)
    state = (multi.init(grads), jnp.float32(2.0**16), jnp.int32(0))
    out["jmp + optax.MultiSteps window"] = (windowed(_jmp_multisteps_step(jmp, tx)), state)
    return out


# The contenders whose passes over the gradients the section reports (counting compiles a
# program of its own, without the timed one's donated state).
COUNTED = ("optclip, loss scaling", "optclip, clip alone", "jmp + optax")


def measure(grads, pairs: int, min_sample_s: float, log) -> tuple[_timing.Paired, dict, list]:
    """The interleaved step times (contenders in `names` order) and the passes over the
    gradients in the compiled programs of those `COUNTED`."""
    made = contenders(grads)
    names = list(made)
    runners, passes = [], {}
    for name in names:
        fn, state = made[name]
        if name in COUNTED:
            passes[name] = _passes.passes_of(fn, (grads, state))
        jitted = jax.jit(fn, donate_argnums=(1,))
        box = [jax.tree.map(jnp.copy, state)]

        def run(jitted=jitted, box=box):
            updates, box[0] = jitted(grads, box[0])
            return updates

        runners.append(run)
    log(f"loss scaling: step timing ({', '.join(names)})")
    paired = _timing.interleaved(runners, pairs=pairs, min_sample_s=min_sample_s)
    return paired, passes, names
