"""The guards of a large run together: a Flax NNX model with scanned blocks, in float16.

A small residual network learns a fixed random "teacher" function by mean squared error on
fresh batches of Gaussian inputs: an input layer (``embed``), ``LAYERS`` residual blocks of
LayerNorm + Linear + tanh, created once with ``nnx.split_rngs`` + ``nnx.vmap`` (each weight of
a block is one leaf stacked along a layer axis) and applied with ``nnx.scan``, and an output
layer (``head``). It computes in float16 (``dtype=jnp.float16``) from float32 master weights
(``param_dtype=jnp.float32``), in one ``nnx.jit`` step, with an ``nnx.Optimizer`` whose
transformation holds every guard of the guide "Training a large model"::

    optclip.guarded(
        optax.chain(optclip.adagc(...), optax.adamw(...)),       # per-tensor thresholds
        clip=optclip.global_clip(1.0, stacked="blocks", group_norms="layer"),  # + layer norms
        loss_scale=optclip.DynamicLossScale(),                   # starts at 2**16
        skip_spikes=optclip.SpikeSkip(window=..., k=..., min_history=...),
    )

The loss is multiplied by ``optclip.loss_scale(optimizer.opt_state)`` before differentiating,
and the unscaled loss is passed as ``value=`` for the spike test's loss. Two events are
planted so that the guards visibly act:

* the first loss scale, 2**16, is too large: the float16 gradients overflow, and the first
  steps are skipped while the scale is halved until the gradients fit;
* at step ``--spike-at`` the batch is corrupted (its targets replaced by noise ten times their
  size): the gradient norm and the loss jump far above the window's, and the step is skipped
  as a spike, leaving the weights and the optimizer's state as they were.

Every ``--log-every`` steps a line from ``optclip.metrics(optimizer.opt_state)``: the loss,
the loss scale, the global norm (unscaled, before clipping), the skipped steps and the spikes
so far, and the layer (a group of ``group_norms="layer"``: ``blocks/0`` .. ``blocks/3`` for the
scanned blocks, one group per leaf outside them) whose norm is the largest. The summary at the
end gives the steps skipped for overflow and as spikes (and which), the first and the final
loss, the last step's per-layer norms and AdaGC's clip count per leaf.

Run::

    python examples/large_model.py                           # 400 steps, spike at step 300
    python examples/large_model.py --steps 60 --spike-at 45  # shorter

The default run takes about 30 s on a shared (loaded) 2-core CPU, most of it building the model
and compiling the step; each step then takes about 20 ms.

What to look for: the first step(s) ``skipped (overflow)`` while the scale comes down from
65536 (here one step, to 32768), the ``skipped (spike)`` line at the planted step, the blocks'
norms ``blocks/0`` .. ``blocks/3`` next to the other layers', and a final loss far below the
first. One run, one seed: it shows the guards acting, not how much they help a training run.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import optclip

LAYERS, WIDTH, INPUTS, OUTPUTS, BATCH = 4, 32, 16, 4, 256
MAX_NORM = 1.0
DEFAULT_STEPS, DEFAULT_SPIKE_AT, DEFAULT_LOG_EVERY = 400, 300, 50
SPIKE_NOISE = 10.0  # the corrupted batch's targets: noise this many times the targets' size


class Block(nnx.Module):
    """A residual block: ``x + tanh(Linear(LayerNorm(x)))``, in float16."""

    def __init__(self, rngs):
        half = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, **half)
        self.linear = nnx.Linear(WIDTH, WIDTH, **half)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(self.norm(x)))


class Model(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(rngs)

        half = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
        self.embed = nnx.Linear(INPUTS, WIDTH, **half)
        self.blocks = make_blocks(rngs)  # each leaf stacked: (LAYERS, ...)
        self.head = nnx.Linear(WIDTH, OUTPUTS, **half)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(self.embed(x), self.blocks))


TEACHER_KEYS = jax.random.split(jax.random.key(1234), 2)
TEACHER_W1 = jax.random.normal(TEACHER_KEYS[0], (INPUTS, 64)) / np.sqrt(INPUTS)
TEACHER_W2 = jax.random.normal(TEACHER_KEYS[1], (64, OUTPUTS)) / np.sqrt(64 / 4)


def batch(step, spike_at):
    """Batch `step`: inputs and the teacher's targets; noise instead of targets at `spike_at`."""
    key_x, key_noise = jax.random.split(jax.random.fold_in(jax.random.key(0), step))
    x = jax.random.normal(key_x, (BATCH, INPUTS))
    targets = jnp.tanh(x @ TEACHER_W1) @ TEACHER_W2
    if step == spike_at:  # a corrupted batch (decided on the host: the step is known)
        scale = SPIKE_NOISE * jnp.sqrt(jnp.mean(targets**2))
        targets = scale * jax.random.normal(key_noise, targets.shape)
    return x, targets


def make_optimizer(model, window):
    optimizer = optclip.guarded(
        # AdaGC inside the guard sees the gradients after the clip (unscaled, clipped at
        # MAX_NORM) and reads them again for its per-leaf norms: it is not one of the clips that
        # fold the loss scale into their one read. A skipped step leaves its state unchanged.
        optax.chain(
            optclip.adagc(max_norm=MAX_NORM, warmup_steps=50),
            optax.adamw(3e-3, weight_decay=1e-4),
        ),
        clip=optclip.global_clip(MAX_NORM, stacked="blocks", group_norms="layer"),
        loss_scale=optclip.DynamicLossScale(),  # 2**16, x2 after 2000 finite steps in a row
        skip_spikes=optclip.SpikeSkip(window=window, k=6.0, min_history=window // 2),
    )
    return nnx.Optimizer(model, optimizer, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, x, targets):
    scale = optclip.loss_scale(optimizer.opt_state)

    def scaled_loss(model):
        prediction = model(x).astype(jnp.float32)
        return jnp.mean((prediction - targets) ** 2) * scale

    scaled, grads = nnx.value_and_grad(scaled_loss)(model)  # float32 grads of float32 weights
    loss = scaled / scale
    optimizer.update(model, grads, value=loss)  # `value`: the loss, for the spike test
    return loss, optclip.metrics(optimizer.opt_state)


GROUP = "global_clip/group_norm/"


def status(logged, before):
    """Why the step was skipped, from the counters' change: "overflow", "spike" or ""."""
    if logged["loss_scale/overflow_count"] > before["loss_scale/overflow_count"]:
        return "overflow"
    if logged["skip_spikes/spike_count"] > before["skip_spikes/spike_count"]:
        return "spike"
    return ""


def log_line(step, loss, logged, why):
    groups = {k.removeprefix(GROUP): v for k, v in logged.items() if k.startswith(GROUP)}
    largest = max(groups, key=lambda name: groups[name])
    return (
        f"step {step:4d}  loss {loss:8.4f}  scale {logged['loss_scale/loss_scale']:6.0f}  "
        f"norm {logged['guarded/global_norm']:8.3g}  skipped {logged['guarded/skip_count']:2d}  "
        f"spikes {logged['skip_spikes/spike_count']}  largest {largest} "
        f"({groups[largest]:.3g})  {f'skipped ({why})' if why else ''}".rstrip()
    )


def train(steps, spike_at, log_every, window):
    """Trains and prints a line every `log_every` steps (and at every skipped step); returns
    the losses, the logged metrics and why each step was skipped ("" if not), step by step."""
    model = Model(nnx.Rngs(0))
    optimizer = make_optimizer(model, window)
    losses, history, why = [], [], []
    before = jax.device_get(optclip.metrics(optimizer.opt_state))
    for step in range(steps):
        loss, logged = train_step(model, optimizer, *batch(step, spike_at))
        loss, logged = jax.device_get((loss, logged))
        losses.append(float(loss))
        history.append(logged)
        why.append(status(logged, before))
        before = logged
        if step % log_every == 0 or step == steps - 1 or why[-1]:
            print(log_line(step, float(loss), logged, why[-1]), flush=True)
    return np.array(losses), history, why


def summary(losses, history, why):
    overflows = [step for step, w in enumerate(why) if w == "overflow"]
    spikes = [step for step, w in enumerate(why) if w == "spike"]
    last = history[-1]
    scales = [float(history[s]["loss_scale/loss_scale"]) for s in overflows]
    lines = [
        f"steps skipped for overflow: {len(overflows)} (steps {overflows}; the scale after "
        f"them: {', '.join(f'{s:.0f}' for s in scales)})",
        f"steps skipped as spikes: {len(spikes)} (steps {spikes})",
        f"loss: first {losses[0]:.4f}, final {losses[-1]:.4f} ({losses[-1] / losses[0]:.3g}x)",
        "per-layer norms of the last step:",
    ]
    for name, value in last.items():
        if name.startswith(GROUP):
            lines.append(f"  {name.removeprefix(GROUP):14} {float(value):.4g}")
    lines.append("AdaGC's clip count per leaf:")
    prefix = "adagc/leaf_clip_count/"
    for name, value in last.items():
        if name.startswith(prefix):
            lines.append(f"  {name.removeprefix(prefix):22} {int(value)}")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    parser.add_argument(
        "--spike-at", type=int, default=DEFAULT_SPIKE_AT, help="the step whose batch is corrupted"
    )
    parser.add_argument("--log-every", type=int, default=DEFAULT_LOG_EVERY, help="log interval")
    parser.add_argument("--window", type=int, default=40, help="the spike test's window")
    args = parser.parse_args(argv)
    if args.window < 4:
        parser.error(f"--window must be >= 4, got {args.window}")
    if args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if not args.window // 2 + 10 <= args.spike_at < args.steps:
        parser.error(
            f"--spike-at must be in [window // 2 + 10, steps) = [{args.window // 2 + 10}, "
            f"{args.steps}): the spike test needs a history first"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {args.steps} steps of batch "
        f"{BATCH}; {LAYERS} scanned blocks of width {WIDTH}, float16 compute, float32 weights; "
        f"corrupted batch at step {args.spike_at}"
    )
    start = time.perf_counter()
    losses, history, why = train(args.steps, args.spike_at, args.log_every, args.window)
    print(f"trained in {time.perf_counter() - start:.1f} s")
    print(summary(losses, history, why))
    return losses, history, why


if __name__ == "__main__":
    main()
