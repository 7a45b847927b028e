"""An LSTM whose gradients explode without clipping, trained four ways.

The task is the adding problem (Hochreiter & Schmidhuber, 1997) over 100 time steps: each
input step holds a random number in [0, 1) and a marker bit; two steps are marked, one in
each half of the sequence, and the target is the sum of the two marked numbers. Always
predicting the mean scores a mean squared error of 1/6 ~ 0.167; solving the task scores ~0.

The same LSTM (written in plain JAX, ``jax.lax.scan`` over time) starts from the same
weights and sees the same batches under SGD with momentum 0.9 at a learning rate of 1.0
(0.1 for the last 30% of the steps), four times:

* no clipping: in four steps the gradient of the recurrent weights, back-propagated through
  100 time steps, grows by many orders of magnitude (from 1.5 to 8.6e14 when measured); the
  update it makes saturates the LSTM, the read-out weights then diverge, and the loss
  overflows to inf within about 20 steps;
* ``optclip.value_clip``: every gradient element clamped to [-0.1, 0.1];
* ``optclip.norm_clip``: each weight's gradient rescaled to norm <= 1 on its own;
* ``optclip.global_clip``: the whole gradient rescaled to global norm <= 1, one factor for all
  weights, so its direction is kept (Pascanu et al., 2013, https://arxiv.org/abs/1211.5063).

It prints progress, then a table: the loss on held-out sequences at the end, the largest
gradient norm seen, how many steps were clipped, and whether the loss became NaN or inf. In
the ``global_clip`` run the gradient norm and the clip count are read from the optimizer
state (``optax.tree.get(opt_state, "global_norm")``); the other runs compute
``optclip.global_norm(grads)`` themselves.

Run::

    python examples/rnn_exploding_gradients.py                 # about 1-2 minutes on 2 cores
    python examples/rnn_exploding_gradients.py --steps 500 --plot curves.png

``--plot`` needs matplotlib (``pip install -e ".[examples]"``).
"""

import argparse
import functools
import importlib.util
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip

SEQ_LEN = 100
HIDDEN = 32
BATCH = 128
EVAL_BATCH = 1000
LEARNING_RATE = 1.0
MOMENTUM = 0.9
MODES = ("no clipping", "value_clip", "norm_clip", "global_clip")
THRESHOLDS = {"value_clip": 0.1, "norm_clip": 1.0, "global_clip": 1.0}
INIT_SEED = 0
DATA_SEED = 1
EVAL_SEED = 2


@functools.partial(jax.jit, static_argnums=(1, 2))
def adding_problem(key, batch_size, seq_len=SEQ_LEN):
    """A batch of the adding problem: inputs (batch, time, 2) and targets (batch,)."""
    key_values, key_first, key_second = jax.random.split(key, 3)
    values = jax.random.uniform(key_values, (batch_size, seq_len))
    half = seq_len // 2
    first = jax.random.randint(key_first, (batch_size,), 0, half)
    second = jax.random.randint(key_second, (batch_size,), half, seq_len)
    markers = jax.nn.one_hot(first, seq_len) + jax.nn.one_hot(second, seq_len)
    inputs = jnp.stack([values, markers], axis=-1)
    targets = jnp.sum(values * markers, axis=1)
    return inputs, targets


@jax.jit
def init_params(key):
    """LSTM weights (gates in the order input, forget, cell, output) and a linear read-out."""
    hidden = HIDDEN
    key_rec, key_in, key_out = jax.random.split(key, 3)
    forget_bias = jnp.zeros(4 * hidden).at[hidden : 2 * hidden].set(1.0)
    return {
        "w_in": 0.5 * jax.random.normal(key_in, (2, 4 * hidden)),
        "w_rec": jax.nn.initializers.orthogonal()(key_rec, (hidden, 4 * hidden)),
        "bias": forget_bias,
        "w_out": jax.random.normal(key_out, (hidden,)) / math.sqrt(hidden),
        "b_out": jnp.zeros(()),
    }


def lstm_step(params, carry, x_t):
    """One LSTM time step."""
    h, c = carry
    z = x_t @ params["w_in"] + h @ params["w_rec"] + params["bias"]
    i, f, g, o = jnp.split(z, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), None


def predict(params, inputs):
    """Run the LSTM over the time axis with `lax.scan` and read out the last hidden state."""
    zeros = jnp.zeros((inputs.shape[0], params["w_rec"].shape[0]))
    time_major = jnp.swapaxes(inputs, 0, 1)
    (h, _), _ = jax.lax.scan(
        lambda carry, x_t: lstm_step(params, carry, x_t), (zeros, zeros), time_major
    )
    return h @ params["w_out"] + params["b_out"]


def loss_fn(params, inputs, targets):
    """Mean squared error."""
    return jnp.mean((predict(params, inputs) - targets) ** 2)


def make_optimizer(mode, steps):
    """SGD with momentum, behind the clipping transformation of `mode`. The learning rate
    drops tenfold for the last 30% of the steps, to settle the final loss."""
    schedule = optax.piecewise_constant_schedule(LEARNING_RATE, {int(0.7 * steps): 0.1})
    sgd = optax.sgd(schedule, momentum=MOMENTUM)
    if mode == "no clipping":
        return sgd
    clips = {
        "value_clip": optclip.value_clip,  # each element into [-threshold, threshold]
        "norm_clip": optclip.norm_clip,  # each weight's gradient to norm <= threshold
        "global_clip": optclip.global_clip,  # the whole gradient to norm <= threshold
    }
    return optax.chain(clips[mode](THRESHOLDS[mode]), sgd)


def mode_label(mode):
    """The mode with its threshold, for printing."""
    return f"{mode}({THRESHOLDS[mode]:g})" if mode in THRESHOLDS else mode


def clips_this_step(mode, grads):
    """Whether the clip of `mode` changes these gradients (for the modes without a counter)."""
    if mode == "value_clip":
        largest = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads)]))
        return largest > THRESHOLDS[mode]
    if mode == "norm_clip":
        largest = jnp.max(jnp.stack([optclip.global_norm(g) for g in jax.tree.leaves(grads)]))
        return largest > THRESHOLDS[mode]
    return jnp.array(False)


@jax.jit
def loss_and_grads(params, key):
    """The loss and gradients on one fresh batch (compiled once, shared by every mode)."""
    inputs, targets = adding_problem(key, BATCH)
    return jax.value_and_grad(loss_fn)(params, inputs, targets)


def make_apply_step(mode, optimizer):
    """A jitted step that clips and applies the gradients; it returns the new params and
    state, the gradient norm before clipping, and whether the clip changed the gradients."""

    @jax.jit
    def apply_step(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if mode == "global_clip":
            # global_clip keeps the pre-clip norm in its state: no second pass over the grads.
            grad_norm = optax.tree.get(opt_state, "global_norm")
        else:
            grad_norm = optclip.global_norm(grads)
        return params, opt_state, grad_norm, clips_this_step(mode, grads)

    return apply_step


def should_log(step, steps, log_every):
    """Every `log_every` steps, the last step, and steps 1, 2, 4, 8, ... before the first
    `log_every` (where an explosion happens)."""
    is_power_of_two = step & (step - 1) == 0
    return step % log_every == 0 or step == steps - 1 or (step < log_every and is_power_of_two)


def train(mode, steps, log_every=0):
    """Train one model with `mode`; return its history and summary."""
    optimizer = make_optimizer(mode, steps)
    params = init_params(jax.random.key(INIT_SEED))
    opt_state = optimizer.init(params)
    apply_step = make_apply_step(mode, optimizer)
    data_key = jax.random.key(DATA_SEED)
    losses, grad_norms, clipped_steps, nan_step = [], [], 0, None
    for step in range(steps):
        loss, grads = loss_and_grads(params, jax.random.fold_in(data_key, step))
        params, opt_state, grad_norm, clipped = apply_step(params, opt_state, grads)
        losses.append(float(loss))
        grad_norms.append(float(grad_norm))
        clipped_steps += int(clipped)
        if log_every and should_log(step, steps, log_every):
            print(
                f"  {mode_label(mode):<18} step {step:>5}/{steps}  loss {losses[-1]:<10.4g}"
                f"  grad norm {grad_norms[-1]:.3g}",
                flush=True,
            )
        if not math.isfinite(losses[-1]):
            nan_step = step
            print(
                f"  {mode_label(mode):<18} step {step:>5}/{steps}  loss is {losses[-1]}:"
                " stopping this run",
                flush=True,
            )
            break
    if mode == "global_clip":
        clipped_steps = int(optax.tree.get(opt_state, "clip_count"))
    return {
        "mode": mode,
        "losses": losses,
        "grad_norms": grad_norms,
        "final_loss": float(held_out_loss(params)),
        "max_grad_norm": max(n if math.isfinite(n) else math.inf for n in grad_norms),
        "clipped_steps": clipped_steps,
        "steps_run": len(losses),
        "nan_step": nan_step,
    }


@jax.jit
def held_out_loss(params):
    """The loss on a fixed set of sequences never trained on."""
    return loss_fn(params, *adding_problem(jax.random.key(EVAL_SEED), EVAL_BATCH))


def mean_baseline():
    """Held-out loss of always predicting the mean target (1.0)."""
    _, eval_targets = adding_problem(jax.random.key(EVAL_SEED), EVAL_BATCH)
    return float(jnp.mean((eval_targets - 1.0) ** 2))


def format_table(results):
    """The results as a text table."""
    header = (
        f"{'mode':<18} {'final loss':>10} {'max grad norm':>14} {'steps clipped':>14}"
        f"  {'NaN or inf'}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if r["mode"] == "no clipping":
            clipped = "-"
        else:
            clipped = f"{r['clipped_steps']}/{r['steps_run']}"
        nan = "no" if r["nan_step"] is None else f"yes, at step {r['nan_step']}"
        lines.append(
            f"{mode_label(r['mode']):<18} {r['final_loss']:>10.4g} "
            f"{r['max_grad_norm']:>14.3g} {clipped:>14}  {nan}"
        )
    return "\n".join(lines)


def plot(results, path):
    """Save loss and gradient-norm curves to `path` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_norm) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = np.arange(len(r["losses"]))
        ax_loss.plot(steps, np.asarray(r["losses"]), label=mode_label(r["mode"]), lw=0.8)
        ax_norm.plot(steps, np.asarray(r["grad_norms"]), label=mode_label(r["mode"]), lw=0.8)
    ax_loss.axhline(mean_baseline(), color="gray", ls="--", lw=0.8, label="predict the mean")
    ax_loss.set_ylim(top=1e3)  # an exploding run leaves through the top
    for ax, title in ((ax_loss, "training loss"), (ax_norm, "gradient norm before clipping")):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="training steps per mode")
    parser.add_argument("--plot", metavar="PATH", help="save loss and gradient-norm curves here")
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error('--plot needs matplotlib: python -m pip install -e ".[examples]"')
    return args


def main(argv=None):
    args = parse_args(argv)
    print(
        f"adding problem, {SEQ_LEN} time steps; LSTM with {HIDDEN} units; SGD, momentum "
        f"{MOMENTUM}, learning rate {LEARNING_RATE} (0.1 for the last 30% of the steps); "
        f"{args.steps} steps per mode"
    )
    start = time.perf_counter()
    results = []
    for mode in MODES:
        print(f"\n{mode_label(mode)}")
        results.append(train(mode, args.steps, log_every=max(1, args.steps // 10)))
    print(
        f"\nResults after {args.steps} steps "
        f"(final loss on {EVAL_BATCH} held-out sequences; "
        f"predicting the mean scores {mean_baseline():.4f}):\n"
    )
    print(format_table(results))
    print(f"\ntotal time {time.perf_counter() - start:.0f} s")
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
