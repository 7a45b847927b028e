"""DP-SGD on the demo's LSTM: the adding problem learned privately, with ghost clipping.

The model and the task are those of ``rnn_exploding_gradients.py`` (an LSTM in plain JAX,
``lax.scan`` over 20 time steps, whose gradients explode without clipping). Here the
training set is fixed: 50,000 sequences of the adding problem, made once. Training is
DP-SGD, as in ``private_training.py``:

* each step draws a Poisson sample of the training set (each sequence in with probability
  q = 500/50,000), padded to a fixed batch of 600 rows with ``is_padding_example``;
* ``optclip.clipped_grad(loss, l2_clip_norm=1.0, ...)`` sums the examples' gradients, each
  clipped to norm 1, without forming any example's gradient: the recurrent weight's norm
  comes from its inputs and output gradients at every time step, the cross terms between
  the steps included (``optclip.ghost_report`` prints which parameters went ghost);
* Gaussian noise of standard deviation ``1.0 * 1.0`` (noise multiplier times clip norm) is
  added to the sum, which is divided by the expected batch size and handed to Adam.

It prints the report, the clipped sum checked against the materialising reference
(``method="vmap"``), then the held-out loss and the share of clipped examples as training
goes, next to the same model trained without privacy on the same batches, behind
``optclip.global_clip(1.0)`` (the demo's clip), and the privacy spent: epsilon at delta =
1e-5 from ``dp_accounting``'s RDP accountant when it is installed (it comes with
jax-privacy). Predicting the mean scores a held-out loss of about 0.167; a model that has
learned the task scores near 0.

One training run is chaotic (see the demo's docstring): the digits differ between machines.

Run::

    python examples/private_lstm.py          # about a minute on 2 cores
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import private_training as dp  # (this folder) Poisson samples, the noise, epsilon
import rnn_exploding_gradients as demo  # (this folder) the task and the LSTM

import optclip

TRAIN = 50_000
EXPECTED_BATCH = 500
PADDED_BATCH = 600  # the Poisson sample's size is about 500 +- 22: 600 is 4.5 sigma above
LEARNING_RATE = 3e-3
DATA_SEED = 7  # the training set (the held-out set is the demo's)
RATE = EXPECTED_BATCH / TRAIN


def make_data():
    """The training set: TRAIN sequences of the adding problem, ``(inputs, targets)``."""
    return demo.adding_problem(jax.random.key(DATA_SEED), TRAIN)


private_grad = optclip.clipped_grad(
    demo.loss_fn, l2_clip_norm=dp.CLIP, batch_argnums=(1, 2), return_grad_norms=True
)


def train(steps: int, private: bool, data):
    """Adam on DP-SGD's noisy clipped sums, or behind `global_clip(1.0)` on the batch's mean
    gradient (non-private); the held-out loss every `steps // 5` steps with the share of
    clipped examples since the last (DP-SGD), and the seconds per step."""
    params = demo.init_params(jax.random.key(demo.INIT_SEED))
    opt = optax.adam(LEARNING_RATE)
    if not private:
        opt = optax.chain(optclip.global_clip(dp.CLIP), opt)

    @jax.jit
    def step(params, opt_state, key):
        sample_key, noise_key = jax.random.split(key)
        inputs, targets, padding = dp.poisson_batch(sample_key, data, EXPECTED_BATCH, PADDED_BATCH)
        real = ~padding
        if private:
            summed, aux = private_grad(params, inputs, targets, is_padding_example=padding)
            grads = dp.noisy_mean(summed, noise_key, EXPECTED_BATCH)
            clipped = jnp.sum((aux.grad_norms > dp.CLIP) & real) / jnp.maximum(jnp.sum(real), 1)
        else:
            weights = real / jnp.maximum(jnp.sum(real), 1)
            errors = lambda p: demo.predict(p, inputs) - targets  # noqa: E731
            grads = jax.grad(lambda p: jnp.sum(weights * errors(p) ** 2))(params)
            clipped = jnp.float32(0.0)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, clipped

    opt_state, history, shares, seconds = opt.init(params), [], [], 0.0
    for i, key in enumerate(jax.random.split(jax.random.key(demo.DATA_SEED), steps)):
        start = time.perf_counter()
        params, opt_state, clipped = step(params, opt_state, key)
        shares.append(float(clipped))  # (waits for the step)
        seconds += (time.perf_counter() - start) if i else 0.0  # (the first step compiles)
        if (i + 1) % max(1, steps // 5) == 0:
            loss = float(demo.held_out_loss(params))
            history.append((i + 1, loss, float(np.mean(shares[-(steps // 5) :]))))
    return params, history, seconds / max(steps - 1, 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    data = make_data()
    params = demo.init_params(jax.random.key(demo.INIT_SEED))
    inputs, targets, _ = dp.poisson_batch(jax.random.key(0), data, EXPECTED_BATCH, PADDED_BATCH)
    print("Which parameters go ghost (optclip.ghost_report):")
    print(optclip.ghost_report(demo.loss_fn, params, inputs, targets, batch_argnums=(1, 2)))
    difference = dp.check_against_vmap(params, data, demo.loss_fn, EXPECTED_BATCH, PADDED_BATCH)
    print(f"clipped sum vs method='vmap': max relative difference {difference:.1e}")
    print()
    runs = {"DP-SGD": train(args.steps, True, data), "non-private": train(args.steps, False, data)}
    print(f"held-out loss (predicting the mean: {demo.mean_baseline():.3f})")
    print(f"{'step':>5}  {'DP-SGD':>8}  {'clipped':>7}  {'non-private':>11}")
    for (s, loss, share), (_, base, _) in zip(runs["DP-SGD"][1], runs["non-private"][1]):
        print(f"{s:5d}  {loss:8.4f}  {share:7.0%}  {base:11.4f}")
    dp.print_cost(runs, args.steps, RATE, PADDED_BATCH, digits=1)
    print(f"({time.perf_counter() - start:.0f} s)")
    return runs


if __name__ == "__main__":
    main()
