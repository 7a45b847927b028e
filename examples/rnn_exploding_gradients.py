"""An LSTM whose gradients explode without clipping, trained four ways, over several seeds.

The task is the adding problem (Hochreiter & Schmidhuber, 1997) over 20 time steps: each
input step holds a random number in [0, 1) and a marker bit; two steps are marked, one in
each half of the sequence, and the target is the sum of the two marked numbers. Always
predicting the mean scores a mean squared error of 1/6 ~ 0.167; solving the task scores ~0.

An LSTM written in plain JAX (``jax.lax.scan`` over time) is trained with SGD (momentum 0.9,
learning rate 1.0, then 0.1 for the last 30% of the steps) four ways: without clipping, and
behind ``optclip.value_clip(0.1)`` (every gradient element clamped to [-0.1, 0.1]),
``optclip.norm_clip(1.0)`` (each weight's gradient rescaled to norm <= 1 on its own) and
``optclip.global_clip(1.0)`` (the whole gradient rescaled to global norm <= 1, one factor for
all weights, so its direction is kept: Pascanu et al., 2013, https://arxiv.org/abs/1211.5063).

One training run is chaotic: a difference in the last bit of one gradient, from another CPU's
code generation or another version of a library, grows over hundreds of steps, and a run that
left the mean predictor's plateau on one machine can stay on it on another. So every mode is
trained from several seeds (each seed: its own initial weights and its own batches; seed k
gets the same weights and batches in every mode), and the demo reports statistics over them.
The seeds are batched with ``jax.vmap`` inside one jitted ``lax.scan`` training loop per mode,
the optimizer's and the clip's states included: ``global_clip``'s ``global_norm`` and
``clip_count`` are read from the vmapped state (``optax.tree.get(opt_state, "global_norm")``).

It prints the machine (CPU model, JAX version), progress, then a table with a row per mode:
how many seeds solved the task (held-out loss below 0.01 at the end, against ~0.17 for the
mean predictor), the median and the range of the final held-out loss, the median and the
largest over the seeds of each seed's largest gradient norm, the median number of steps
clipped, and how many seeds' training loss became NaN or inf, and the median step at which.
The digits differ between machines; the README states what held across several.

Run::

    python examples/rnn_exploding_gradients.py                 # 1 to 3 minutes on 2 cores
    python examples/rnn_exploding_gradients.py --plot curves.png
    python examples/rnn_exploding_gradients.py --seeds 16 --first-seed 100 --steps 1000

``--plot PATH`` saves three panels, each mode's median over the seeds as a line and the range
over the seeds as a band: the unclipped runs' first steps, then the training loss and the
gradient norm of the clipped runs. It needs matplotlib (``pip install -e ".[examples]"``).
"""

import argparse
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

SEQ_LEN = 20
HIDDEN = 32
BATCH = 128
EVAL_BATCH = 1000
LEARNING_RATE = 1.0
MOMENTUM = 0.9
LOW_RATE_FROM = 0.7  # the learning rate drops tenfold for the last 30% of the steps
MODES = ("no clipping", "value_clip", "norm_clip", "global_clip")
THRESHOLDS = {"value_clip": 0.1, "norm_clip": 1.0, "global_clip": 1.0}
DEFAULT_STEPS = 800
DEFAULT_SEEDS = 8
SOLVED_BELOW = 0.01  # held-out loss: the plateau is 0.167, a solved run ends near 3e-4
MEAN_PREDICTOR_LOSS = 1 / 6  # E[(a + b - 1)^2] for a, b uniform in [0, 1)
INIT_SEED = 0  # seed k's initial weights come from fold_in(key(INIT_SEED), k)
DATA_SEED = 1  # and its batches from fold_in(key(DATA_SEED), k)
EVAL_SEED = 2  # the held-out sequences, the same for every seed and mode
GROWTH_STEPS = 5  # steps over which the recurrent weights' gradient norm is printed
PROGRESS_LINES = 10  # progress lines per mode (one per chunk of the training loop)
PLOT_POINTS = 100  # the plot's loss and norm curves are means over steps/PLOT_POINTS steps
FIGSIZE = (13, 4.2)  # inches
DPI = 100
FONT_SIZE = 10
BAND_ALPHA = 0.25
BAND_SUFFIX = ": min-max over seeds"  # the bands' labels (one legend entry for all of them)


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
        "note: the clipped runs start on a plateau (loss ~0.17, what predicting the mean "
        "scores); in the default run most seeds leave it between steps 100 and 400 (a few "
        f"norm_clip seeds later, or never). With fewer than the default {DEFAULT_STEPS} steps, "
        "some or all seeds may end on it. The explosion without clipping shows in the first "
        "few dozen steps of any run."
    )


# ---- the task and the model -------------------------------------------------------------


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


def held_out_loss(params):
    """The loss on a fixed set of sequences never trained on."""
    return loss_fn(params, *adding_problem(jax.random.key(EVAL_SEED), EVAL_BATCH))


held_out_losses = jax.jit(jax.vmap(held_out_loss))  # every seed's, compiled once


def mean_baseline():
    """Held-out loss of always predicting the mean target (1.0)."""
    _, eval_targets = adding_problem(jax.random.key(EVAL_SEED), EVAL_BATCH)
    return float(jnp.mean((eval_targets - 1.0) ** 2))


# ---- training: every seed of one mode in one jitted, vmapped scan --------------------------


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


def norm_and_clipped(mode, grads, opt_state):
    """The gradient's global norm before clipping, and whether the clip changed the gradient."""
    if mode == "global_clip":
        # global_clip keeps the pre-clip norm in its state: no second pass over the gradient.
        norm = optax.tree.get(opt_state, "global_norm")
        return norm, norm > THRESHOLDS[mode]
    norm = optclip.global_norm(grads)
    leaves = jax.tree.leaves(grads)
    if mode == "value_clip":
        largest = jnp.max(jnp.stack([jnp.max(jnp.abs(leaf)) for leaf in leaves]))
    elif mode == "norm_clip":
        largest = jnp.max(jnp.stack([optclip.global_norm(leaf) for leaf in leaves]))
    else:
        return norm, jnp.array(False)
    return norm, largest > THRESHOLDS[mode]


def seed_start(seed):
    """Seed `seed`'s initial weights and data key: the same in every mode."""
    params = init_params(jax.random.fold_in(jax.random.key(INIT_SEED), seed))
    return params, jax.random.fold_in(jax.random.key(DATA_SEED), seed)


seeds_start = jax.jit(jax.vmap(seed_start))  # every seed's, compiled once


def make_training(mode, steps, chunk):
    """Two jitted functions, vmapped over seeds: `start(seeds)` gives every seed's initial
    (params, optimizer state, data key), and `advance(state, first_step)` trains every seed
    `chunk` steps with a `lax.scan` and returns the new state and each step's record."""
    optimizer = make_optimizer(mode, steps)
    init_optimizer = jax.jit(jax.vmap(optimizer.init))

    def start(seeds):
        params, data_keys = seeds_start(seeds)
        return params, init_optimizer(params), data_keys

    def train_step(state, step):
        params, opt_state, data_key = state
        inputs, targets = adding_problem(jax.random.fold_in(data_key, step), BATCH)
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        norm, clipped = norm_and_clipped(mode, grads, opt_state)
        record = {
            "losses": loss,
            "grad_norms": norm,
            "clipped": clipped,
            "recurrent_grad_norms": optclip.global_norm(grads["w_rec"]),
        }
        return (params, opt_state, data_key), record

    def advance_one(state, first_step):
        return jax.lax.scan(train_step, state, first_step + jnp.arange(chunk))

    return start, jax.jit(jax.vmap(advance_one, in_axes=(0, None)))


def chunk_length(steps):
    """The largest divisor of `steps` that is at most steps / PROGRESS_LINES (one compile)."""
    target = max(1, steps // PROGRESS_LINES)
    return max(d for d in range(1, target + 1) if steps % d == 0)


def train(mode, steps, seeds, progress=True):
    """Train one model per seed in `seeds` with `mode`, all at once; return the records.

    The training stops early when every seed's loss is NaN or inf (nothing is left to learn),
    so the records may be shorter than `steps`.
    """
    begin = time.perf_counter()
    chunk = chunk_length(steps)
    start, advance = make_training(mode, steps, chunk)
    state = start(jnp.asarray(seeds))
    chunks = []
    for first_step in range(0, steps, chunk):
        state, record = advance(state, first_step)
        chunks.append(jax.tree.map(np.asarray, record))
        last = chunks[-1]["losses"][:, -1]
        if progress:
            median, lowest, highest = median_and_range(last)
            print(
                f"  {mode_label(mode):<16} step {first_step + chunk:>5}/{steps}  training loss "
                f"median {median:<9.3g} [{lowest:.3g}, {highest:.3g}]  "
                f"finite in {np.isfinite(last).sum()}/{len(seeds)} seeds",
                flush=True,
            )
        if not np.isfinite(last).any():
            if progress:
                print(f"  {mode_label(mode):<16} every seed's loss is NaN or inf: stopping")
            break
    params, opt_state, _ = state
    result = {key: np.concatenate([c[key] for c in chunks], axis=1) for key in chunks[0]}
    result["mode"] = mode
    result["steps"] = steps
    result["seeds"] = np.asarray(seeds)
    result["final_loss"] = np.asarray(held_out_losses(params))
    # global_clip counts the updates it scaled down in its own (vmapped) state.
    result["clip_count"] = (
        np.asarray(optax.tree.get(opt_state, "clip_count")) if mode == "global_clip" else None
    )
    result["seconds"] = time.perf_counter() - begin
    return result


# ---- statistics over the seeds -------------------------------------------------------------


def as_ordered(values):
    """Values with NaN counted as +inf, so that a run that blew up ranks above every other."""
    values = np.asarray(values, dtype=float)
    return np.where(np.isnan(values), np.inf, values)


def median_and_range(values, axis=None):
    """Median, min and max of `values` (NaN counted as +inf)."""
    values = as_ordered(values)
    return np.median(values, axis=axis), np.min(values, axis=axis), np.max(values, axis=axis)


def first_nonfinite_step(losses):
    """Per seed (rows), the first step (column) whose loss is NaN or inf; -1 if none."""
    bad = ~np.isfinite(np.asarray(losses, dtype=float))
    return np.where(bad.any(axis=1), np.argmax(bad, axis=1), -1)


def largest_finite(values):
    """Per seed (rows), the largest finite value; NaN if there is none."""
    values = np.asarray(values, dtype=float)
    finite = np.isfinite(values)
    largest = np.max(np.where(finite, values, -np.inf), axis=1)
    return np.where(finite.any(axis=1), largest, np.nan)


def per_seed(result):
    """Each seed's numbers, from one mode's records."""
    final_loss = as_ordered(result["final_loss"])
    if result["mode"] == "no clipping":
        clipped_steps = None
    elif result["clip_count"] is not None:
        clipped_steps = np.asarray(result["clip_count"])
    else:
        clipped_steps = np.asarray(result["clipped"]).sum(axis=1)
    return {
        "final_loss": final_loss,
        "solved": final_loss < SOLVED_BELOW,
        "max_grad_norm": largest_finite(result["grad_norms"]),
        "clipped_steps": clipped_steps,
        "nonfinite_step": first_nonfinite_step(result["losses"]),
    }


def summarize(result):
    """The statistics over the seeds that the table prints, for one mode."""
    seeds = per_seed(result)
    loss_median, loss_min, loss_max = median_and_range(seeds["final_loss"])
    norm_median, _, norm_max = median_and_range(seeds["max_grad_norm"])
    nonfinite = seeds["nonfinite_step"][seeds["nonfinite_step"] >= 0]
    clipped = seeds["clipped_steps"]
    return {
        "mode": result["mode"],
        "seeds": len(seeds["final_loss"]),
        "solved": int(seeds["solved"].sum()),
        "final_loss_median": float(loss_median),
        "final_loss_min": float(loss_min),
        "final_loss_max": float(loss_max),
        "max_grad_norm_median": float(norm_median),
        "max_grad_norm_max": float(norm_max),
        "clipped_steps_median": None if clipped is None else float(np.median(clipped)),
        "steps_run": np.asarray(result["losses"]).shape[1],
        "nonfinite_seeds": len(nonfinite),
        "nonfinite_step_median": float(np.median(nonfinite)) if len(nonfinite) else None,
    }


TABLE_HEADER = (
    ("", "solved", "final loss", "", "max grad norm", "", "steps clipped", "NaN or inf", ""),
    ("mode", f"(<{SOLVED_BELOW:g})", "median", "[min, max]", "median", "max", "median", "seeds",
     "median step"),
)  # fmt: skip


def table_cells(summary):
    """One mode's row of the table, cell by cell (the columns of TABLE_HEADER)."""
    seeds = summary["seeds"]
    clipped = summary["clipped_steps_median"]
    nonfinite_step = summary["nonfinite_step_median"]
    return [
        mode_label(summary["mode"]),
        f"{summary['solved']}/{seeds}",
        f"{summary['final_loss_median']:.2g}",
        f"[{summary['final_loss_min']:.2g}, {summary['final_loss_max']:.2g}]",
        f"{summary['max_grad_norm_median']:.3g}",
        f"{summary['max_grad_norm_max']:.3g}",
        "-" if clipped is None else f"{clipped:g}/{summary['steps_run']}",
        f"{summary['nonfinite_seeds']}/{seeds}",
        "-" if nonfinite_step is None else f"{nonfinite_step:g}",
    ]


def format_table(results):
    """The statistics of every mode as a text table (columns two spaces apart). A title in
    the first header line spans its column and the next one when the next one has none."""
    titles, subtitles = TABLE_HEADER
    rows = [list(subtitles), *(table_cells(summarize(r)) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(subtitles))]
    spans = [i + 1 < len(titles) and not titles[i + 1] for i in range(len(titles))]
    for i, title in enumerate(titles):
        room = widths[i] + (2 + widths[i + 1] if spans[i] else 0)
        widths[i] += max(0, len(title) - room)
    first = [
        title.ljust(widths[i] + (2 + widths[i + 1] if spans[i] else 0))
        for i, title in enumerate(titles)
        if i == 0 or not spans[i - 1]
    ]
    lines = [
        "  ".join(cells).rstrip()
        for cells in ([first] + [[cell.ljust(w) for cell, w in zip(row, widths)] for row in rows])
    ]
    lines.insert(2, "-" * len(lines[1]))
    return "\n".join(lines)


def growth_line(result):
    """The recurrent weights' gradient norm over the first steps: median [min, max]."""
    norms = np.asarray(result["recurrent_grad_norms"])[:, :GROWTH_STEPS]
    medians, lows, highs = median_and_range(norms, axis=0)
    return ", ".join(f"{m:.2g} [{lo:.2g}, {hi:.2g}]" for m, lo, hi in zip(medians, lows, highs))


# ---- the plot ------------------------------------------------------------------------------


def window_means(values, window):
    """Per seed (rows), means over consecutive windows of `window` steps (a window holding a
    NaN or inf gives inf); returns the windows' centre steps and the means."""
    values = as_ordered(values)
    blocks = values.shape[1] // window
    means = values[:, : blocks * window].reshape(len(values), blocks, window).mean(axis=2)
    return window * np.arange(blocks) + (window - 1) / 2, means


def log_limits(values):
    """Whole-decade limits of a log axis that hold every positive finite value of `values`."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values) & (values > 0)]
    return 10.0 ** math.floor(math.log10(values.min())), 10.0 ** math.ceil(math.log10(values.max()))


def draw_band(ax, steps, values, color, label):
    """The median over the seeds as a line, the min-max range as a band. Returns the band's
    (median, min, max); a value that is NaN or inf is left out of the line and the band runs
    through the top of the axis there. Call it after the axis limits are set."""
    median, lowest, highest = median_and_range(values, axis=0)
    top = ax.get_ylim()[1]
    ax.fill_between(
        steps,
        np.where(np.isfinite(lowest), lowest, np.nan),
        np.where(np.isfinite(highest), highest, 10 * top),
        color=color,
        alpha=BAND_ALPHA,
        lw=0,
        label=label + BAND_SUFFIX,
    )
    ax.plot(steps, np.where(np.isfinite(median), median, np.nan), color=color, lw=1.5, label=label)
    return median, lowest, highest


def mean_line(ax):
    """The mean predictor's loss, drawn over the curves and bands."""
    ax.axhline(
        MEAN_PREDICTOR_LOSS, color="black", ls="--", lw=1.5, zorder=5, label="predict the mean"
    )


def plot_explosion(ax, unclipped):
    """The unclipped runs' first steps: gradient norm and training loss, median and range."""
    steps_run = np.asarray(unclipped["losses"]).shape[1]
    overflow = first_nonfinite_step(unclipped["losses"])
    last = min(steps_run, (overflow.max() if (overflow >= 0).all() else steps_run) + 3)
    steps = np.arange(last)
    norms = np.asarray(unclipped["grad_norms"])[:, :last]
    losses = np.asarray(unclipped["losses"])[:, :last]
    ax.set_ylim(*log_limits(np.concatenate([norms.ravel(), losses.ravel(), [1.0]])))
    color = f"C{MODES.index('no clipping')}"
    draw_band(ax, steps, norms, color, "no clipping: gradient norm")
    loss_median = median_and_range(losses, axis=0)[0]
    ax.plot(
        steps,
        np.where(np.isfinite(loss_median), loss_median, np.nan),
        color=color,
        ls=":",
        label="no clipping: training loss",
    )
    mean_line(ax)
    ax.set_xlim(0, last - 1)
    ax.set_title("no clipping: the first steps")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm; training loss")


def plot(results, path):
    """Save the curves to `path` (needs matplotlib) and return the Figure.

    Three panels with a logarithmic y axis; in each, every mode's median over the seeds is a
    line and its min-max range a band. First the unclipped runs' first steps (gradient norm
    and training loss, up to where every seed's loss is NaN or inf); then the training loss
    and the gradient norm of the clipped runs, as means over windows of steps/PLOT_POINTS
    steps. The mean predictor's loss is a dashed line drawn over the curves; the legend has
    the figure's right-hand side to itself.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.patches import Patch

    fig = Figure(figsize=FIGSIZE)
    ax_first, ax_loss, ax_norm = fig.subplots(1, 3, width_ratios=(1, 1.6, 1.6))
    for ax in fig.axes:
        ax.set_yscale("log")  # first: limits set on a linear axis may be negative
        ax.tick_params(labelsize=FONT_SIZE)
    unclipped = next((r for r in results if r["mode"] == "no clipping"), None)
    if unclipped is not None:
        plot_explosion(ax_first, unclipped)
    else:
        ax_first.set_axis_off()

    clipped = [r for r in results if r["mode"] != "no clipping"]
    steps = max(r["steps"] for r in results)
    window = max(1, steps // PLOT_POINTS)
    for ax, key, reference in (
        (ax_loss, "losses", MEAN_PREDICTOR_LOSS),
        (ax_norm, "grad_norms", THRESHOLDS["global_clip"]),
    ):
        curves = [window_means(r[key], window) for r in clipped]
        ax.set_ylim(*log_limits(np.concatenate([m.ravel() for _, m in curves] + [[reference]])))
        for r, (centres, means) in zip(clipped, curves):
            draw_band(ax, centres, means, f"C{MODES.index(r['mode'])}", mode_label(r["mode"]))
        ax.axvline(LOW_RATE_FROM * steps, color="gray", ls=":", lw=1, label="learning rate / 10")
        ax.set_xlim(0, steps)
        ax.set_xlabel("step")
    mean_line(ax_loss)
    ax_norm.axhline(1.0, color="gray", ls="-.", lw=1, label="global_clip's threshold")
    over = "per step" if window == 1 else f"mean over {window} steps"
    ax_loss.set_title(f"training loss ({over})")
    ax_loss.set_ylabel("mean squared error")
    ax_norm.set_title(f"gradient norm before clipping ({over})")
    ax_norm.set_ylabel("global norm of the gradient")
    for ax in fig.axes:
        ax.title.set_fontsize(FONT_SIZE + 1)
        ax.xaxis.label.set_fontsize(FONT_SIZE)
        ax.yaxis.label.set_fontsize(FONT_SIZE)

    # One legend for every panel, in a column of its own on the right: it hides no curve.
    entries = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if not label.endswith(BAND_SUFFIX):
                entries.setdefault(label, handle)
    entries["min-max over the seeds"] = Patch(color="gray", alpha=BAND_ALPHA, lw=0)
    fig.legend(entries.values(), entries.keys(), loc="center right", fontsize=FONT_SIZE)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=DPI)
    print(f"saved {path}")
    return fig


# ---- the command line -----------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps per mode")
    parser.add_argument(
        "--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per mode (trained at once)"
    )
    parser.add_argument("--first-seed", type=int, default=0, help="seeds are FIRST, FIRST+1, ...")
    parser.add_argument("--plot", metavar="PATH", help="save loss and gradient-norm curves here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        parser.error(f"--steps and --seeds must be >= 1, got {args.steps} and {args.seeds}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error('--plot needs matplotlib: python -m pip install -e ".[examples]"')
    return args


def main(argv=None):
    args = parse_args(argv)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    print(f"machine: {machine_description()}")
    print(
        f"adding problem, {SEQ_LEN} time steps; LSTM with {HIDDEN} units; SGD, momentum "
        f"{MOMENTUM}, learning rate {LEARNING_RATE} (0.1 for the last 30% of the steps); "
        f"batch {BATCH}; {args.steps} steps per mode; seeds {seeds[0]}..{seeds[-1]}, trained "
        "at once (jax.vmap)"
    )
    note = short_run_note(args.steps)
    if note:
        print(note)
    begin = time.perf_counter()
    results = []
    for mode in MODES:
        print(f"\n{mode_label(mode)}")
        results.append(train(mode, args.steps, seeds))
        print(f"  {results[-1]['seconds']:.0f} s")
    print(
        f"\nStatistics over {len(seeds)} seeds after {args.steps} steps (held-out loss on "
        f"{EVAL_BATCH} sequences; predicting the mean scores {mean_baseline():.3f}; NaN "
        "counts as inf):\n"
    )
    print(format_table(results))
    unclipped = results[MODES.index("no clipping")]
    print(
        f"\nno clipping: norm of the recurrent weights' gradient over the first "
        f"{GROWTH_STEPS} steps, median [min, max]: {growth_line(unclipped)}"
    )
    if note:
        print(note)
    print(f"\ntotal time {time.perf_counter() - begin:.0f} s")
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
