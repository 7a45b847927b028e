"""DP-SGD on a small text classifier, at the cost of ordinary training: ghost clipping.

The data are made here: sequences of 16 tokens from a vocabulary of 64, labelled 1 when at
least two of their tokens are "rare" (ids below 8), about 60% of them; one training label in
ten is flipped (noise a private model must not memorise), the held-out labels are clean. The
model embeds each token (a 64 x 32 table), averages the embeddings over the sequence, and
classifies the average with a 32-64-2 ReLU MLP. Training is DP-SGD:

* each step draws a Poisson sample of the 4096 training sequences (each one in with
  probability q = 256/4096), padded to a fixed batch of 320 rows with ``is_padding_example``
  marking the padding (which contributes exactly zero);
* ``optclip.clipped_grad(loss, l2_clip_norm=C, ...)`` sums the examples' gradients, each
  clipped to norm C, without forming any example's gradient: the norms come from each
  layer's inputs and output gradients (ghost clipping) — ``optclip.ghost_report`` prints
  which parameters went ghost;
* Gaussian noise of standard deviation ``sigma * C`` is added to the sum, which is divided by
  the expected batch size and handed to Adam.

It prints the report, the clipped sum checked against the materialising reference
(``method="vmap"``), then the held-out accuracy and the share of clipped examples as training
goes, next to the same model trained without privacy, and the privacy spent: epsilon at
delta = 1e-5 from ``dp_accounting``'s RDP accountant when it is installed (it comes with
jax-privacy: ``pip install dp-accounting``).

Run::

    python examples/private_training.py          # about 30 s of CPU time
"""

import argparse
import importlib.util
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip

VOCAB, LENGTH, WIDTH, HIDDEN = 64, 16, 32, 64
TRAIN, TEST = 4096, 2048
EXPECTED_BATCH = 256
PADDED_BATCH = 320  # the Poisson sample's size is about 256 +- 16: 320 is 4 sigma above
CLIP = 1.0
SIGMA = 1.0  # the noise multiplier
DELTA = 1e-5
LEARNING_RATE = 2e-2


def make_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (TRAIN + TEST, LENGTH))
    labels = (np.sum(tokens < 8, axis=1) >= 2).astype(np.int32)
    noisy = np.where(rng.random(TRAIN) < 0.1, 1 - labels[:TRAIN], labels[:TRAIN])
    return (
        (jnp.asarray(tokens[:TRAIN]), jnp.asarray(noisy)),
        (jnp.asarray(tokens[TRAIN:]), jnp.asarray(labels[TRAIN:])),
    )


def init_params(seed: int = 0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    return {
        "embed": normal(VOCAB, WIDTH, scale=1.0),
        "hidden": {"kernel": normal(WIDTH, HIDDEN, scale=WIDTH**-0.5), "bias": jnp.zeros(HIDDEN)},
        "out": {"kernel": normal(HIDDEN, 2, scale=HIDDEN**-0.5), "bias": jnp.zeros(2)},
    }


def logits_of(params, tokens):
    x = jnp.mean(params["embed"][tokens], axis=-2)
    x = jax.nn.relu(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return x @ params["out"]["kernel"] + params["out"]["bias"]


def loss(params, tokens, labels):
    """The mean cross-entropy of a batch (for one example, a batch of one)."""
    logp = jax.nn.log_softmax(logits_of(params, tokens))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def accuracy(params, data) -> float:
    tokens, labels = data
    return float(jnp.mean(jnp.argmax(logits_of(params, tokens), -1) == labels))


def poisson_batch(key, data, expected=EXPECTED_BATCH, padded=PADDED_BATCH):
    """A Poisson sample of `data` (arrays of one length: each row in with probability
    ``expected / length``), padded to `padded` rows: ``(*rows of each array,
    is_padding_example)``. The chosen rows come first; a sample over `padded` is cut."""
    size = data[0].shape[0]
    chosen = jax.random.bernoulli(key, expected / size, (size,))
    order = jnp.argsort(~chosen)[:padded]
    return (*(x[order] for x in data), ~chosen[order])


def noisy_mean(summed, key, expected=EXPECTED_BATCH):
    """DP-SGD's gradient: the clipped sum `summed` (a tree) plus Gaussian noise of standard
    deviation ``SIGMA * CLIP`` on every entry, divided by the expected batch size."""
    leaves, tree = jax.tree.flatten(summed)
    keys = jax.random.split(key, len(leaves))
    noisy = [g + SIGMA * CLIP * jax.random.normal(k, g.shape) for g, k in zip(leaves, keys)]
    return jax.tree.map(lambda g: g / expected, jax.tree.unflatten(tree, noisy))


private_grad = optclip.clipped_grad(
    loss, l2_clip_norm=CLIP, batch_argnums=(1, 2), return_grad_norms=True
)


def train(steps: int, private: bool, data, test, seed: int = 0):
    """Adam on DP-SGD's noisy clipped sums (or plain mean gradients); the held-out accuracy
    and the share of clipped examples every `steps // 5` steps."""
    params, opt = init_params(seed), optax.adam(LEARNING_RATE)

    @jax.jit
    def step(params, opt_state, key):
        sample_key, noise_key = jax.random.split(key)
        tokens, labels, padding = poisson_batch(sample_key, data)
        if private:
            summed, aux = private_grad(params, tokens, labels, is_padding_example=padding)
            grads = noisy_mean(summed, noise_key)
            real = ~padding
            clipped = jnp.sum((aux.grad_norms > CLIP) & real) / jnp.maximum(jnp.sum(real), 1)
        else:
            weights = (~padding).astype(jnp.float32) / EXPECTED_BATCH
            grads = jax.grad(lambda p: jnp.sum(weights * per_example_losses(p, tokens, labels)))(
                params
            )
            clipped = jnp.float32(0.0)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, clipped

    opt_state, history, shares, seconds = opt.init(params), [], [], 0.0
    for i, key in enumerate(jax.random.split(jax.random.key(seed), steps)):
        start = time.perf_counter()
        params, opt_state, clipped = step(params, opt_state, key)
        shares.append(float(clipped))  # (waits for the step)
        seconds += (time.perf_counter() - start) if i else 0.0  # (the first step compiles)
        if (i + 1) % max(1, steps // 5) == 0:
            history.append((i + 1, accuracy(params, test), float(np.mean(shares[-(steps // 5) :]))))
    return params, history, seconds / max(steps - 1, 1)


def per_example_losses(params, tokens, labels):
    logp = jax.nn.log_softmax(logits_of(params, tokens))
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def epsilon(steps: int, rate: float = EXPECTED_BATCH / TRAIN):
    """Epsilon at DELTA of `steps` Gaussian steps of noise multiplier SIGMA on Poisson samples
    at `rate` (dp_accounting's RDP accountant), or None without dp_accounting."""
    if importlib.util.find_spec("dp_accounting") is None:
        return None
    import dp_accounting

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(SIGMA)),
        steps,
    )
    logging.getLogger("absl").setLevel(logging.ERROR)  # (orders it cannot bound are skipped)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def check_against_vmap(params, data, loss_fn=loss, expected=EXPECTED_BATCH, padded=PADDED_BATCH):
    """The largest relative difference between the ghost clipped sum of `loss_fn` and the
    materialising reference's (``method="vmap"``), jitted, on one padded Poisson batch."""
    *batch, padding = poisson_batch(jax.random.key(123), data, expected, padded)
    ways = [
        optclip.clipped_grad(loss_fn, l2_clip_norm=CLIP, batch_argnums=(1, 2), method=method)
        for method in ("auto", "vmap")
    ]
    ghost, want = (jax.jit(f)(params, *batch, is_padding_example=padding) for f in ways)
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for a, b in zip(jax.tree.leaves(ghost), jax.tree.leaves(want))
    )


def print_cost(runs, steps, rate=EXPECTED_BATCH / TRAIN, padded=PADDED_BATCH, digits=2):
    """The time per step of the two `runs` (``{"DP-SGD": ..., "non-private": ...}``, each
    `train`'s ``(params, history, seconds per step)``) and the privacy spent."""
    private_s, plain_s = runs["DP-SGD"][2], runs["non-private"][2]
    print(
        f"time per step: DP-SGD {private_s * 1e3:.{digits}f} ms, "
        f"non-private {plain_s * 1e3:.{digits}f} ms "
        f"({private_s / plain_s:.1f}x; this machine, batches of {padded})"
    )
    eps = epsilon(steps, rate)
    spent = "install dp-accounting for epsilon" if eps is None else f"epsilon = {eps:.2f}"
    print(
        f"\nnoise multiplier {SIGMA}, clip norm {CLIP}, sampling rate {rate:.4f}, "
        f"{steps} steps: {spent} at delta = {DELTA:g}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    data, test = make_data()
    params = init_params()
    tokens, labels, _ = poisson_batch(jax.random.key(0), data)
    print("Which parameters go ghost (optclip.ghost_report):")
    print(optclip.ghost_report(loss, params, tokens, labels, batch_argnums=(1, 2)))
    difference = check_against_vmap(params, data)
    print(f"clipped sum vs method='vmap': max relative difference {difference:.1e}")
    print()
    runs = {
        "DP-SGD": train(args.steps, True, data, test),
        "non-private": train(args.steps, False, data, test),
    }
    print(f"{'step':>5}  {'DP-SGD acc':>10}  {'clipped':>7}  {'non-private acc':>15}")
    for (s, acc, share), (_, base, _) in zip(runs["DP-SGD"][1], runs["non-private"][1]):
        print(f"{s:5d}  {acc:10.3f}  {share:7.0%}  {base:15.3f}")
    print_cost(runs, args.steps)
    print(f"({time.perf_counter() - start:.0f} s)")
    return runs


if __name__ == "__main__":
    main()
