"""An LSTM whose gradients explode without clipping, trained four ways.

The task is the adding problem (Hochreiter & Schmidhuber, 1997) over 100 time steps: each
input step holds a random number in [0, 1) and a marker bit; two steps are marked, one in
each half of the sequence, and the target is the sum of the two marked numbers. Always
predicting the mean scores a mean squared error of 1/6 ~ 0.167; solving the task scores ~0.

The same LSTM (written in plain JAX, ``jax.lax.scan`` over time) starts from the same
weights and sees the same batches under SGD with momentum 0.9 at a learning rate of 1.0
(0.1 for the last 30% of the steps), four times:

* no clipping: within a few steps the gradient of the recurrent weights, back-propagated
  through 100 time steps, grows by many orders of magnitude (the demo prints its norm over the
  first five steps); the update it makes saturates the LSTM, the read-out weights then
  diverge, and the loss overflows to inf after some 20 steps;
* ``optclip.value_clip``: every gradient element clamped to [-0.1, 0.1];
* ``optclip.norm_clip``: each weight's gradient rescaled to norm <= 1 on its own;
* ``optclip.global_clip``: the whole gradient rescaled to global norm <= 1, one factor for all
  weights, so its direction is kept (Pascanu et al., 2013, https://arxiv.org/abs/1211.5063).

It prints the machine it runs on (CPU model, JAX version), progress, then a table: the loss on
held-out sequences at the end, the largest gradient norm seen, how many steps were clipped,
and whether the loss became NaN or inf. In the ``global_clip`` run the gradient norm and the
clip count are read from the optimizer state (``optax.tree.get(opt_state, "global_norm")``);
the other runs compute ``optclip.global_norm(grads)`` themselves.

The runs are deterministic on one machine with the same versions (fixed seeds), but the
table's digits differ from one CPU to another, and between versions of JAX or optclip that
change the order of a sum: XLA compiles for the CPU it runs on (vector width, fused multiply-add),
and the orthogonal initialisation's QR runs in the LAPACK that SciPy's OpenBLAS picks for the
CPU. A difference in the last bit of one gradient grows over thousands of steps of a chaotic
training run, so the final losses and clip counts vary between machines. What held on every
machine and setting tried is the shape of the result: the unclipped run overflows within a
few dozen steps, and the clipped runs end far below the mean predictor's loss.

The clipped runs start on a plateau (held-out loss ~0.16, what predicting the mean scores)
and leave it after several hundred to a few thousand steps, depending on the clip and the
machine: the default 3000 steps are needed to see the clips solve the task. A shorter run
(``--steps``) still shows the explosion without clipping, and prints a note saying so.

Run::

    python examples/rnn_exploding_gradients.py                 # a few minutes on 2 cores
    python examples/rnn_exploding_gradients.py --plot curves.png

``--plot PATH`` saves three panels: the unclipped run's explosion over its first steps, then
the training loss and the gradient norm of every run. It needs matplotlib
(``pip install -e ".[examples]"``).
"""

import argparse
import functools
import importlib.util
import math
import os
import platform
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
LOW_RATE_FROM = 0.7  # the learning rate drops tenfold for the last 30% of the steps
MODES = ("no clipping", "value_clip", "norm_clip", "global_clip")
THRESHOLDS = {"value_clip": 0.1, "norm_clip": 1.0, "global_clip": 1.0}
INIT_SEED = 0
DATA_SEED = 1
EVAL_SEED = 2
GROWTH_STEPS = 5  # steps over which the recurrent weights' gradient norm is printed
DEFAULT_STEPS = 3000  # enough for every clip to leave the plateau; fewer may not be
FIGSIZE = (15, 4.6)  # inches
DPI = 120


def cpu_model():
    """The CPU's model name ("model name" in /proc/cpuinfo, else what `platform` knows)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_description():
    """The CPU, JAX version, backend and any XLA flags: the table's digits depend on them."""
    text = (
        f"{cpu_model()} ({os.cpu_count()} logical CPUs); jax {jax.__version__}, "
        f"backend {jax.default_backend()}"
    )
    if os.environ.get("XLA_FLAGS"):
        text += f"; XLA_FLAGS={os.environ['XLA_FLAGS']}"
    return text


def short_run_note(steps):
    """A note for runs shorter than the default, which may end before the clips learn, or None."""
    if steps >= DEFAULT_STEPS:
        return None
    return (
        "note: the clipped runs start on a plateau (held-out loss ~0.16, what predicting the "
        "mean scores) and leave it after several hundred to a few thousand steps, depending on "
        f"the clip and the machine; with fewer than the default {DEFAULT_STEPS} steps per "
        "mode, some or all of them may end on it. The explosion without clipping shows in "
        "the first few dozen steps of any run."
    )


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
    schedule = optax.piecewise_constant_schedule(LEARNING_RATE, {int(LOW_RATE_FROM * steps): 0.1})
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
def recurrent_grad_norm(grads):
    """The norm of the recurrent weights' gradient."""
    return optclip.global_norm(grads["w_rec"])


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
    recurrent_grad_norms = []
    for step in range(steps):
        loss, grads = loss_and_grads(params, jax.random.fold_in(data_key, step))
        if step < GROWTH_STEPS:
            recurrent_grad_norms.append(float(recurrent_grad_norm(grads)))
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
        "recurrent_grad_norms": recurrent_grad_norms,
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


def log_limits(values):
    """Whole-decade limits of a log axis that hold every positive finite value of `values`."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values) & (values > 0)]
    return 10.0 ** math.floor(math.log10(values.min())), 10.0 ** math.ceil(math.log10(values.max()))


def plot(results, path):
    """Save the curves to `path` (needs matplotlib) and return the Figure.

    Three panels, all with a logarithmic y axis: the unclipped run's first steps, on a scale
    wide enough for its explosion; then the training loss and the gradient norm of every run,
    with limits that hold every value of the runs that stayed finite. A run that overflowed
    leaves those two through the top (its label says so) instead of squashing the others.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=FIGSIZE)
    ax_first, ax_loss, ax_norm = fig.subplots(1, 3, width_ratios=(1, 2, 2))
    for ax in fig.axes:
        ax.set_yscale("log")  # first: limits set on a linear axis may be negative

    unclipped = next((r for r in results if r["mode"] == "no clipping"), None)
    if unclipped is not None:
        color = f"C{MODES.index('no clipping')}"
        steps = np.arange(len(unclipped["losses"]))
        ax_first.plot(
            steps, unclipped["grad_norms"], color=color, marker=".", label="gradient norm"
        )
        ax_first.plot(steps, unclipped["losses"], color=color, ls="--", marker=".", label="loss")
        ax_first.set_ylim(*log_limits(unclipped["grad_norms"] + unclipped["losses"]))
        ax_first.legend(fontsize=8, loc="upper left")
        overflow = unclipped["nan_step"]
        ax_first.set_title(
            "no clipping" + (f": loss inf at step {overflow}" if overflow is not None else "")
        )
        ax_first.set_xlabel("step")
        ax_first.set_ylabel("gradient norm; training loss")
    else:
        ax_first.set_axis_off()

    finite_runs = [r for r in results if r["nan_step"] is None] or results
    steps = max(len(r["losses"]) for r in results)
    for ax, key in ((ax_loss, "losses"), (ax_norm, "grad_norms")):
        for r in results:
            values = np.asarray(r[key], dtype=float)
            label = mode_label(r["mode"])
            if r["nan_step"] is not None:
                label += " (off the top)"
            color = f"C{MODES.index(r['mode'])}"
            ax.plot(np.arange(len(values)), values, color=color, label=label, lw=0.6)
        held = np.concatenate([np.asarray(r[key], dtype=float) for r in finite_runs])
        if key == "losses":
            baseline = mean_baseline()
            ax.axhline(baseline, color="gray", ls="--", lw=0.8, label="predict the mean")
            held = np.append(held, baseline)
        else:
            ax.axhline(1.0, color="gray", ls=":", lw=0.8, label="global_clip's threshold")
            held = np.append(held, 1.0)
        ax.axvline(
            int(LOW_RATE_FROM * steps),
            color="black",
            ls=":",
            lw=0.8,
            label="learning rate 1.0 -> 0.1",
        )
        ax.set_ylim(*log_limits(held))
        ax.set_xlim(0, steps)
        ax.set_xlabel("step")
    ax_loss.set_title("training loss")
    ax_loss.set_ylabel("mean squared error on the batch")
    ax_norm.set_title("gradient norm before clipping")
    ax_norm.set_ylabel("global norm of the gradient")

    # One legend for the two long panels, below them, where it hides no curve.
    entries = dict(zip(*reversed(ax_loss.get_legend_handles_labels())))
    entries.update(zip(*reversed(ax_norm.get_legend_handles_labels())))
    fig.legend(entries.values(), entries.keys(), loc="lower center", ncol=len(entries), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=DPI)
    print(f"saved {path}")
    return fig


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per mode")
    parser.add_argument("--plot", metavar="PATH", help="save loss and gradient-norm curves here")
    args = parser.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error('--plot needs matplotlib: python -m pip install -e ".[examples]"')
    return args


def main(argv=None):
    args = parse_args(argv)
    print(f"machine: {machine_description()}")
    print(
        f"adding problem, {SEQ_LEN} time steps; LSTM with {HIDDEN} units; SGD, momentum "
        f"{MOMENTUM}, learning rate {LEARNING_RATE} (0.1 for the last 30% of the steps); "
        f"{args.steps} steps per mode"
    )
    note = short_run_note(args.steps)
    if note:
        print(note)
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
    unclipped = results[MODES.index("no clipping")]
    growth = ", ".join(f"{norm:.2g}" for norm in unclipped["recurrent_grad_norms"])
    print(
        f"\nno clipping: norm of the recurrent weights' gradient over the first "
        f"{len(unclipped['recurrent_grad_norms'])} steps: {growth}"
    )
    if note:
        print(note)
    print(f"\ntotal time {time.perf_counter() - start:.0f} s")
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
