"""Private training of models the ghost engine once materialised: memory of each per-example
clipping method.

    python benchmarks/profile/private_frozen.py [--quick] [--model frozen|scaled|tied|traced]
        [--batches 16 64]
        [--json out.json]

``--model frozen`` (the default): a language model whose token embedding is frozen
(``lax.stop_gradient(table)``, vocabulary 8192, d=256) and tied to its output, with learned
positions looked up at ``jnp.arange(T)`` (T=32) and a trainable dense layer: what fine-tuning a
pretrained model's upper layers with DP-SGD looks like. ``--model scaled``: a language model
whose weights are multiplied by numbers before their layers, as muP parametrises them
(unit-variance weights; the embedding, 4 residual dense blocks times ``jnp.sqrt(1 / d)``,
computed in the loss, and the output layer times ``1 / d``, written; vocabulary 8192, d=256,
T=32). ``--model traced``: the same, the blocks' multiplier an argument of the jitted step
(a schedule's value, traced by the step's ``jit``; the loss closes over it). ``--model
tied``: ``scaled``'s with its output layer tied to the embedding, the table looked up as it is
and multiplied by ``1 / d`` as the output layer (one leaf used scaled by two numbers). Side by
side
in one process, XLA's compiled memory analysis of each jitted step (arguments + outputs +
temporaries, less what outputs alias; no run), as a ratio to the non-private step:
``optclip.clipped_grad`` (the frozen table's uses pass no gradient back, the scaled weights are
views: no per-example copy of either), ``jax_privacy.clipped_grad`` and ``jax.vmap(jax.grad)``
+ ``per_example_clip`` (each forms every leaf's per-example gradient), as
``benchmarks/private.py`` runs them (jax_privacy in microbatches past ``--budget-gib``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder's helpers, then benchmarks/'s
import _private_models as models  # noqa: E402
import _timing  # noqa: E402
import private  # noqa: E402


def frozen_model(vocab: int, d: int, seq: int, seed: int = 0):
    """``(loss, params)``: a frozen tied embedding, learned positions, one dense layer."""
    rng = np.random.default_rng(seed)
    params = {
        "embed": jnp.asarray(rng.normal(size=(vocab, d)) * 0.02, jnp.float32),
        "positions": jnp.asarray(rng.normal(size=(seq, d)) * 0.02, jnp.float32),
        "dense": jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), jnp.float32),
    }

    def loss(p, ids):  # the mean over one example's tokens of the next token's log-loss
        table = lax.stop_gradient(p["embed"])
        h = table[ids] + p["positions"][jnp.arange(ids.shape[-1])]
        logits = jnp.tanh(h @ p["dense"]) @ table.T
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    return loss, params


def scaled_model(vocab: int, d: int, seq: int, blocks: int = 4, seed: int = 0):
    """``(loss, params)``: unit-variance weights, each multiplied by a number before its layer
    (muP's multipliers: ``jnp.sqrt(1 / d)`` for the blocks, computed in the loss; ``1 / d``
    for the output layer, a number written in it)."""
    make, params = traced_model(vocab, d, seq, blocks, seed)
    return make(None), params


def tied_model(vocab: int, d: int, seq: int, blocks: int = 4, seed: int = 0):
    """``(loss, params)``: `scaled_model`'s with the output layer the embedding's table,
    transposed and multiplied by ``1 / d`` (looked up as it is: two numbers on one leaf)."""
    make, params = traced_model(vocab, d, seq, blocks, seed, tied=True)
    return make(None), params


def traced_model(vocab: int, d: int, seq: int, blocks: int = 4, seed: int = 0, tied: bool = False):
    """``(make, params)``: `scaled_model`'s (`tied_model`'s with `tied`), ``make(m)`` its loss
    with the blocks' multiplier `m` (None: ``jnp.sqrt(1 / d)`` computed in the loss)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    params = {"embed": normal(vocab, d), "blocks": [normal(d, d) for _ in range(blocks)]}
    if not tied:
        params["head"] = normal(d, vocab)

    def make(m):
        def loss(p, ids):  # the mean over one example's tokens of the next token's log-loss
            h = p["embed"][ids]
            for w in p["blocks"]:
                h = h + jnp.tanh(h @ (w * (jnp.sqrt(1 / d) if m is None else m)))
            head = p["embed"].T if tied else p["head"]
            logp = jax.nn.log_softmax((h @ (head * (1 / d)))[:, :-1])
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

        return loss

    return make, params


MODELS = {
    "frozen": frozen_model,
    "scaled": scaled_model,
    "tied": tied_model,
    "traced": traced_model,
}


def measure(batches, quick: bool, budget_gib: float, model: str = "frozen") -> list[dict]:
    vocab, d, seq = (64, 8, 6) if quick else (8192, 256, 32)
    loss, params = MODELS[model](vocab, d, seq)
    make = loss if model == "traced" else (lambda m: loss)  # (the step's multiplier, or none)
    multiplier = jnp.float32(1 / np.sqrt(d))
    n_params = models.parameter_count(params)
    budget = budget_gib * 2**30
    rows = []
    for size in batches:
        ids = jnp.asarray(np.random.default_rng(size).integers(0, vocab, size=(size, seq)))
        made = private.contenders(make(multiplier), size, n_params, budget)
        base = None
        for name, (_, note) in made.items():

            def step(p, ids, m, name=name, size=size):
                return private.contenders(make(m), size, n_params, budget)[name][0](p, ids)

            peak = private.peak_bytes(jax.jit(step).lower(params, ids, multiplier).compile())
            base = peak if base is None else base
            rows.append(
                dict(method=name, batch=size, peak_bytes=peak, ratio=peak / base, note=note)
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model")
    parser.add_argument("--batches", type=_timing.count, nargs="+", default=[16, 64])
    parser.add_argument("--budget-gib", type=_timing.gib, default=4.0)
    parser.add_argument("--model", choices=sorted(MODELS), default="frozen")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = measure(args.batches, args.quick, args.budget_gib, args.model)
    print(f"{args.model} model, memory: jax {jax.__version__}, {jax.default_backend()}")
    for r in rows:
        note = f"  ({r['note']})" if r["note"] else ""
        print(
            f"batch {r['batch']:4d}  {r['method']:32s} {r['peak_bytes'] / 2**20:10.1f} MiB"
            f"  x {r['ratio']:.3f}{note}"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
