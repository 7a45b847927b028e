"""Float16 training with float32 master weights: dynamic loss scaling folded into the clip.

A small network (a dense 32-64-64-16 MLP, tanh) learns to imitate a fixed random "teacher"
network of the same shape, by mean squared error on fresh batches of 256 Gaussian inputs. The
targets are small, as quantities measured in a coarse unit are: both networks' outputs are
multiples of ``UNIT = 0.01``. The weights are kept in float32; each step casts them to
float16, runs the forward and backward pass in float16, and hands the float32 gradients (of
the float32 weights: the cast's derivative brings them back to float32) to
``optclip.guarded(optax.adam(3e-3), clip=optclip.global_clip(1.0), ...)``. Three runs:

* float32: everything in float32, the reference;
* float16 with loss scaling: the loss is multiplied by ``optclip.loss_scale(opt_state)``
  before differentiating, and the optimizer divides the scale out again inside the clip (no
  pass over the gradients for it) and adjusts it: halved and the step skipped when the
  gradients overflow, doubled after ``GROWTH_INTERVAL`` finite steps in a row;
* float16 without loss scaling: the derivative of the loss reaching the network's output is
  ``2 * UNIT * (prediction - target) / (256 * 16)``: about 5e-8 at the start and less as the
  error shrinks, at or below float16's smallest number (6e-8), so it rounds to zero and most
  of the weights' gradients are exactly zero. The network learns only what the few surviving
  gradients carry, and stalls.

Every run covers the same seeds at once (``jax.vmap`` over the seed, ``jax.lax.scan`` over the
steps). The table gives the final held-out relative error (mean squared error divided by the
targets' mean square, in float32 from the master weights) as the mean and range over the
seeds, its ratio to float32's, the share of weight gradients that were exactly zero over the
last 100 steps, the skipped steps (mean over seeds) and the final loss scale (median).

Run::

    python examples/loss_scaling.py                    # about 30 s of CPU time
    python examples/loss_scaling.py --plot scaling.png  # loss curves and the scale's trace

``--plot PATH`` saves two panels: the held-out relative error of each run (median over the
seeds, the band from the best to the worst seed), and the loss scale of every seed, with its
overflows. It needs matplotlib (``pip install -e ".[examples]"``).
"""

import argparse
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip

WIDTHS = (32, 64, 64, 16)
BATCH = 256
LEARNING_RATE = 3e-3
MAX_NORM = 1.0
GROWTH_INTERVAL = 50
DEFAULT_STEPS = 1500
DEFAULT_SEEDS = 4
EVAL_EVERY = 20
LAST = 100  # the steps over which the share of zero gradients is reported
RUNS = ("float32", "float16, loss scaling", "float16, no loss scaling")


def init_mlp(key, scale=1.0, last_scale=None):
    """Dense layers with normal weights of variance ``scale**2 / fan_in``; the last layer's
    `last_scale` instead (0: the student starts by predicting 0)."""
    params = []
    keys = jax.random.split(key, len(WIDTHS) - 1)
    for i, (fan_in, fan_out, k) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], keys)):
        s = last_scale if last_scale is not None and i == len(keys) - 1 else scale
        w = s * jax.random.normal(k, (fan_in, fan_out)) / np.sqrt(fan_in)
        params.append({"w": w, "b": jnp.zeros(fan_out)})
    return params


def mlp(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


TEACHER = init_mlp(jax.random.key(1234))
UNIT = 1e-2  # the targets' unit: the networks' outputs are multiples of it


def batch(key, size=BATCH):
    x = jax.random.normal(key, (size, WIDTHS[0]))
    return x, UNIT * mlp(TEACHER, x)


def loss_in(dtype, params, x, targets):
    """Mean squared error with the forward (and so the backward) pass in `dtype`."""
    cast = jax.tree.map(lambda p: p.astype(dtype), params)
    prediction = UNIT * mlp(cast, x.astype(dtype)).astype(jnp.float32)
    return jnp.mean((prediction - targets) ** 2)


def make_optimizer(run):
    loss_scale = optclip.DynamicLossScale(growth_interval=GROWTH_INTERVAL)
    return optclip.guarded(
        optax.adam(LEARNING_RATE),
        clip=optclip.global_clip(MAX_NORM),
        loss_scale=loss_scale if run == "float16, loss scaling" else None,
    )


def train_one(run, seed, steps):
    """One seed's run: ``(held-out losses every EVAL_EVERY steps, loss scale of every step,
    skipped steps, share of zero gradients over the last LAST steps)``."""
    dtype = jnp.float32 if run == "float32" else jnp.float16
    optimizer = make_optimizer(run)
    init_key, data_key = jax.random.split(jax.random.fold_in(jax.random.key(0), seed))
    params = init_mlp(init_key, last_scale=0.0)
    eval_x, eval_t = batch(jax.random.key(99), 1024)

    def step(carry, key):
        params, opt_state = carry
        scale = 1.0 if opt_state.scaler is None else optclip.loss_scale(opt_state)
        x, targets = batch(key)
        grads = jax.grad(lambda p: loss_in(dtype, p, x, targets) * scale)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        weights = [layer["w"] for layer in grads]
        zeros = sum(jnp.sum(w == 0) for w in weights) / sum(w.size for w in weights)
        scale_now = 1.0 if opt_state.scaler is None else optclip.loss_scale(opt_state)
        return (params, opt_state), (jnp.asarray(scale_now, jnp.float32), zeros)

    def steps_then_eval(carry, keys):
        carry, traces = jax.lax.scan(step, carry, keys)
        relative = loss_in(jnp.float32, carry[0], eval_x, eval_t) / jnp.mean(eval_t**2)
        return carry, (relative, traces)

    keys = jax.random.split(data_key, steps // EVAL_EVERY * EVAL_EVERY)
    keys = keys.reshape(steps // EVAL_EVERY, EVAL_EVERY, *keys.shape[1:])
    (_, opt_state), (losses, (scales, zeros)) = jax.lax.scan(
        steps_then_eval, (params, optimizer.init(params)), keys
    )
    zeros = zeros.reshape(-1)[-LAST:].mean()
    return losses, scales.reshape(-1), opt_state.skip_count, zeros


def train(run, seeds, steps):
    """Every seed of one run at once (vmap over the seed): a dict of NumPy arrays."""
    fn = jax.jit(jax.vmap(lambda seed: train_one(run, seed, steps)))
    losses, scales, skipped, zeros = jax.device_get(fn(jnp.arange(seeds)))
    return {"losses": losses, "scales": scales, "skipped": skipped, "zeros": zeros}


def format_table(results):
    reference = results["float32"]["losses"][:, -1]
    lines = [
        f"{'run':<26}{'final rel. error: mean (min-max)':<40}{'vs float32':>11}"
        f"{'zero grads':>12}{'skipped':>9}{'final scale':>13}"
    ]
    for run, r in results.items():
        final = r["losses"][:, -1]
        spread = f"{final.mean():.2e} ({final.min():.2e}-{final.max():.2e})"
        lines.append(
            f"{run:<26}{spread:<40}{final.mean() / reference.mean():>10.2f}x"
            f"{100 * r['zeros'].mean():>11.1f}%{r['skipped'].mean():>9.1f}"
            f"{np.median(r['scales'][:, -1]):>13.0f}"
        )
    return "\n".join(lines)


def plot(results, path, steps):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(12, 4.5))
    evals = np.arange(1, steps // EVAL_EVERY + 1) * EVAL_EVERY
    colors = {"float32": "black", "float16, loss scaling": "tab:blue"}
    colors["float16, no loss scaling"] = "tab:red"
    for run, r in results.items():
        losses = r["losses"]
        ax_loss.plot(evals, np.median(losses, axis=0), color=colors[run], label=run)
        ax_loss.fill_between(evals, losses.min(0), losses.max(0), color=colors[run], alpha=0.2)
    ax_loss.set(yscale="log", xlabel="step", ylabel="held-out MSE / mean square of targets")
    ax_loss.set_title(f"Held-out relative error, median and range over {len(losses)} seeds")
    ax_loss.legend()
    scales = results["float16, loss scaling"]["scales"]
    for i, trace in enumerate(scales):
        ax_scale.plot(
            np.arange(1, steps + 1),
            trace,
            color="tab:blue",
            alpha=0.6,
            lw=1,
            label="loss scale (each seed)" if i == 0 else None,
        )
        drops = np.flatnonzero(np.diff(trace) < 0) + 1
        ax_scale.plot(
            drops + 1,
            trace[drops],
            "v",
            color="tab:orange",
            ms=4,
            label="overflow: step skipped, scale halved" if i == 0 else None,
        )
    ax_scale.set(yscale="log", xlabel="step", ylabel="loss scale")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_title(f"Dynamic loss scale (x2 after {GROWTH_INTERVAL} finite steps)")
    ax_scale.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per run")
    parser.add_argument("--plot", metavar="PATH", help="save the loss curves and scale here")
    args = parser.parse_args(argv)
    if args.steps < EVAL_EVERY or args.seeds < 1:
        parser.error(f"--steps must be >= {EVAL_EVERY} and --seeds >= 1")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error('--plot needs matplotlib: pip install -e ".[examples]"')
    return args


def main(argv=None):
    args = parse_args(argv)
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {args.seeds} seeds, "
        f"{args.steps} steps of batch {BATCH}, MLP {'-'.join(map(str, WIDTHS))}"
    )
    results = {}
    for run in RUNS:
        start = time.perf_counter()
        results[run] = train(run, args.seeds, args.steps)
        print(f"  {run}: {time.perf_counter() - start:.1f} s", flush=True)
    print(format_table(results))
    if args.plot:
        plot(results, args.plot, args.steps)
        print(f"plot saved to {args.plot}")
    return results


if __name__ == "__main__":
    main()
