"""Private training's cost on recurrent models and a GroupNorm convnet.

    python benchmarks/recurrent.py [--quick] [--json out.json]
    python benchmarks/recurrent.py --only eqx-gru --batches 64 --methods ghost
    python benchmarks/recurrent.py --only eqx-gru hk-deeprnn --seqs 16 64 --batches 256
    python benchmarks/recurrent.py --markdown out.json  (a saved run's table)
    python benchmarks/recurrent.py --markdown a.json --beside b.json  (two runs side by side)

``benchmarks/private.py``'s measurement (its ``measure``: XLA's compiled memory analysis of
each jitted step, and its time in rounds interleaved with the non-private ``jax.grad`` step;
every figure a ratio to the non-private step; ``optclip.clipped_grad``,
``jax_privacy.clipped_grad`` and ``vmap(grad)`` + ``per_example_clip`` side by side in one
process) on the models users write with Equinox, Flax and plain JAX, with random weights
(hidden 128, T=32; batches 32, 64 and 128):

* ``eqx-gru``: an ``eqx.nn.GRUCell`` (32 input features, hidden 128) under ``lax.scan``, its
  last state into a linear head to 10 classes; cross-entropy.
* ``eqx-lstm-lm``: an ``eqx.nn.Embedding`` (vocabulary 256, width 64), an ``eqx.nn.LSTMCell``
  (64 -> 128) under ``lax.scan`` and a linear head to the vocabulary; next-token
  cross-entropy.
* ``flax-lstm``: Flax Linen's ``nn.RNN(nn.LSTMCell(128))`` (32 input features, its gates a
  ``Dense`` each), its last output into a ``Dense`` head to 10 classes.
* ``flax-gru``: the same with ``nn.GRUCell(128)`` (its gates a ``Dense`` each, the state's
  candidate gate with a bias of its own inside the reset gate's product).
* ``jax-lstm``: ``eqx-lstm-lm`` in plain JAX, its LSTM written by hand with one fused gate
  weight (and bias) split into the 4 gates' with ``jnp.split`` at every step, as dm-haiku's
  ``hk.GRU`` splits its weights.
* ``hk-deeprnn``: dm-haiku's ``hk.DeepRNN([hk.LSTM(128), hk.GRU(128)])`` language model
  under ``hk.dynamic_unroll``, between an ``hk.Embed`` (vocabulary 256, width 64) and an
  ``hk.Linear`` head to the vocabulary (``hk.GRU`` splits its weights into the gates');
  next-token cross-entropy.
* ``eqx-convnet``: ``eqx.nn.Conv2d`` 3x3 stem + ``eqx.nn.GroupNorm`` (8 groups), 2 residual
  blocks of a depthwise ``Conv2d(groups=channels)`` 3x3, a ``GroupNorm`` and a pointwise 1x1
  ``Conv2d``, mean-pooled into a linear head to 10; 32x32x3 images, 32 channels.

Each loss is called per example with a leading batch axis of 1 (as jax_privacy and
``clipped_grad`` call it; the Equinox models ``vmap`` over it) and returns the batch's mean.
Beside the figures, ``optclip.ghost_report``'s leaves that ``clipped_grad`` materialises
(their per-example gradients formed): how many, their parameters, and the first one's reason.
``--seqs``: other sequence lengths than 32 (each recurrent model's rows named with its ``T``;
the convnet runs once). ``--quick``: batch 16 and T=8 (a smoke test). A run under
``XLA_FLAGS`` (XLA's CPU scheduler set to order for memory, say) keeps them in its ``--json``
file; ``--markdown FILE --beside FILE2`` prints two runs' private steps side by side.
"""

import dataclasses
import json
import math
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _private_models  # noqa: E402
from private import (  # noqa: E402
    GHOST,
    add_arguments,
    announce,
    cells,
    load_rows,
    measure,
    ratio,
    save_run,
    table,
    where,
)

MODELS = list(_private_models.RECURRENT_MODELS)


@dataclasses.dataclass(frozen=True)
class Shape:
    seq: int = 32
    features: int = 32  # (the classifiers' inputs)
    hidden: int = 128
    classes: int = 10
    vocab: int = 256  # (the language models')
    width: int = 64  # (their embedding's)
    size: int = 32  # (the convnet's images: size x size x 3)
    channels: int = 32
    blocks: int = 2
    groups: int = 8  # (GroupNorm's)


def cross_entropy(logits, labels):
    """Mean over all positions of ``-log softmax(logits)[label]``."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def features(shape: Shape, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, shape.seq, shape.features))
    labels = rng.integers(0, shape.classes, batch)
    return jnp.asarray(x, jnp.float32), jnp.asarray(labels, jnp.int32)


def tokens(shape: Shape, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, shape.vocab, (batch, shape.seq + 1)), jnp.int32)


def images(shape: Shape, batch: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 3, shape.size, shape.size))  # (Equinox's CHW)
    labels = rng.integers(0, shape.classes, batch)
    return jnp.asarray(x, jnp.float32), jnp.asarray(labels, jnp.int32)


def equinox_loss(model, split_tokens: bool = False):
    """``(loss, params)``: `model` (one example in, logits out) split with ``eqx.partition``
    into its arrays and the rest, combined back in the loss and ``vmap``-ed over the batch;
    the batch ``(inputs, labels)``, or with `split_tokens` a batch of token ids whose next
    ones are the labels."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, batch):
        inputs, labels = (batch[:, :-1], batch[:, 1:]) if split_tokens else batch
        return cross_entropy(jax.vmap(eqx.combine(p, static))(inputs), labels)

    return loss, params


class GRUClassifier(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, shape: Shape, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(shape.features, shape.hidden, key=k1)
        self.head = eqx.nn.Linear(shape.hidden, shape.classes, key=k2)

    def __call__(self, xs):  # (T, features) -> (classes,)
        h0 = jnp.zeros(self.cell.hidden_size)
        h, _ = lax.scan(lambda h, x: (self.cell(x, h), None), h0, xs)
        return self.head(h)


class LSTMLanguageModel(eqx.Module):
    embed: eqx.nn.Embedding
    cell: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, shape: Shape, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(shape.vocab, shape.width, key=k1)
        self.cell = eqx.nn.LSTMCell(shape.width, shape.hidden, key=k2)
        self.head = eqx.nn.Linear(shape.hidden, shape.vocab, key=k3)

    def __call__(self, ids):  # (T,) -> (T, vocab)
        def step(state, x):
            state = self.cell(x, state)
            return state, state[0]

        zeros = jnp.zeros(self.cell.hidden_size)
        _, hs = lax.scan(step, (zeros, zeros), jax.vmap(self.embed)(ids))
        return jax.vmap(self.head)(hs)


class GroupNormConvNet(eqx.Module):
    stem: eqx.nn.Conv2d
    stem_norm: eqx.nn.GroupNorm
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, shape: Shape, key):
        keys = jax.random.split(key, 2 + 2 * shape.blocks)
        c, g = shape.channels, shape.groups
        self.stem = eqx.nn.Conv2d(3, c, 3, padding=1, key=keys[0])
        self.stem_norm = eqx.nn.GroupNorm(g, c)
        self.blocks = [
            (
                eqx.nn.Conv2d(c, c, 3, padding=1, groups=c, key=keys[2 + 2 * i]),  # depthwise
                eqx.nn.GroupNorm(g, c),
                eqx.nn.Conv2d(c, c, 1, key=keys[3 + 2 * i]),  # pointwise
            )
            for i in range(shape.blocks)
        ]
        self.head = eqx.nn.Linear(c, shape.classes, key=keys[1])

    def __call__(self, x):  # (3, H, W) -> (classes,)
        h = jax.nn.relu(self.stem_norm(self.stem(x)))
        for depthwise, norm, pointwise in self.blocks:
            h = h + pointwise(jax.nn.relu(norm(depthwise(h))))
        return self.head(jnp.mean(h, axis=(1, 2)))


def flax_rnn(shape: Shape, key, cell: str = "LSTMCell"):
    """``(loss, params)``: Linen's ``nn.RNN`` classifier of ``nn.LSTMCell`` or ``nn.GRUCell``
    (`cell`), applied to the batch as it is (Linen's layers take a batch axis)."""
    import flax.linen as nn

    class Classifier(nn.Module):
        @nn.compact
        def __call__(self, x):  # (batch, T, features) -> (batch, classes)
            h = nn.RNN(getattr(nn, cell)(shape.hidden))(x)
            return nn.Dense(shape.classes)(h[:, -1])

    model = Classifier()
    params = model.init(key, jnp.zeros((1, shape.seq, shape.features)))["params"]

    def loss(p, batch):
        x, labels = batch
        return cross_entropy(model.apply({"params": p}, x), labels)

    return loss, params


def jax_lstm(shape: Shape, seed: int = 0):
    """``(loss, params)``: an LSTM language model in plain JAX, its gates' weights one fused
    ``(width + hidden, 4 hidden)`` matrix (and one bias), split into the four gates' with
    ``jnp.split`` inside the scanned step."""
    rng = np.random.default_rng(seed)
    e, h = shape.width, shape.hidden

    def normal(*dims, fan_in):
        return jnp.asarray(rng.standard_normal(dims) / np.sqrt(fan_in), jnp.float32)

    params = {
        "embed": normal(shape.vocab, e, fan_in=1),
        "lstm": {"kernel": normal(e + h, 4 * h, fan_in=e + h), "bias": jnp.zeros(4 * h)},
        "head": {"kernel": normal(h, shape.vocab, fan_in=h), "bias": jnp.zeros(shape.vocab)},
    }

    def loss(p, ids):  # ids: (batch, T + 1)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        xs = jnp.swapaxes(p["embed"][inputs], 0, 1)  # (T, batch, width)

        def step(state, x):
            hidden, cell = state
            xh = jnp.concatenate([x, hidden], axis=-1)
            w = jnp.split(p["lstm"]["kernel"], 4, axis=1)
            b = jnp.split(p["lstm"]["bias"], 4)
            i, f, g, o = (xh @ w_k + b_k for w_k, b_k in zip(w, b))
            cell = jax.nn.sigmoid(f) * cell + jax.nn.sigmoid(i) * jnp.tanh(g)
            hidden = jax.nn.sigmoid(o) * jnp.tanh(cell)
            return (hidden, cell), hidden

        zeros = jnp.zeros((ids.shape[0], h))
        _, hs = lax.scan(step, (zeros, zeros), xs)
        logits = jnp.swapaxes(hs, 0, 1) @ p["head"]["kernel"] + p["head"]["bias"]
        return cross_entropy(logits, labels)

    return loss, params


def haiku_deeprnn(shape: Shape, key):
    """``(loss, params)``: dm-haiku's ``DeepRNN`` of an ``LSTM`` and a ``GRU`` language
    model, one example's ids in (``hk.dynamic_unroll`` scans the steps), ``vmap``-ed over
    the batch."""
    import haiku as hk

    def logits(ids):  # (T,) -> (T, vocab)
        core = hk.DeepRNN([hk.LSTM(shape.hidden), hk.GRU(shape.hidden)])
        x = hk.Embed(shape.vocab, shape.width)(ids)
        hs, _ = hk.dynamic_unroll(core, x, core.initial_state(None))
        return hk.Linear(shape.vocab)(hs)

    model = hk.without_apply_rng(hk.transform(logits))
    params = model.init(key, jnp.zeros((shape.seq,), jnp.int32))

    def loss(p, ids):  # ids: (batch, T + 1)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        return cross_entropy(jax.vmap(lambda i: model.apply(p, i))(inputs), labels)

    return loss, params


def setups(shape: Shape) -> dict:
    """``name -> (loss, params, batch(size))``."""
    key = jax.random.key(0)
    return {
        "eqx-gru": (
            *equinox_loss(GRUClassifier(shape, key)),
            lambda b: features(shape, b),
        ),
        "eqx-lstm-lm": (
            *equinox_loss(LSTMLanguageModel(shape, key), split_tokens=True),
            lambda b: tokens(shape, b),
        ),
        "flax-lstm": (*flax_rnn(shape, key), lambda b: features(shape, b)),
        "flax-gru": (*flax_rnn(shape, key, "GRUCell"), lambda b: features(shape, b)),
        "jax-lstm": (*jax_lstm(shape), lambda b: tokens(shape, b)),
        "hk-deeprnn": (*haiku_deeprnn(shape, key), lambda b: tokens(shape, b)),
        "eqx-convnet": (*equinox_loss(GroupNormConvNet(shape, key)), lambda b: images(shape, b)),
    }


def materialised(loss, params, batch) -> dict:
    """What ``optclip.ghost_report`` says ``clipped_grad`` materialises: how many leaves,
    their parameters, and the first one's path and reason."""
    import optclip

    report = optclip.ghost_report(loss, params, batch)
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
    found = [
        (path, r, n)
        for (path, r), n in zip(report.items(), sizes, strict=True)
        if r.mode == "materialised"
    ]
    first = f"{found[0][0]}: {found[0][1].reason}" if found else ""
    return {
        "materialised": len(found),
        "materialised_params": sum(n for *_, n in found),
        "first_materialised": first,
    }


def flags(path: pathlib.Path) -> str:
    """The ``XLA_FLAGS`` a saved run ran under (``save_run`` keeps them), or ``default``."""
    data = json.loads(path.read_text())
    return (
        f"`{data['xla_flags']}`" if isinstance(data, dict) and data.get("xla_flags") else "default"
    )


def markdown(rows) -> str:
    """The run's table: per model and batch, `private.markdown`'s ratios to the non-private
    step, then the leaves ``clipped_grad`` materialises (count, parameters) and the first
    one's reason."""
    lines = [
        "| model, batch | `clipped_grad` memory | time | `jax_privacy.clipped_grad` memory "
        "| time | `vmap(grad)` + clip memory | materialised leaves | first reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {name: k for k, name in enumerate(MODELS)}

    def key(model_batch):  # (the models in `MODELS`' order, then by T, then by batch)
        name, _, seq = model_batch[0].partition(" T=")
        return order[name], int(seq or 0), model_batch[1]

    keys = sorted({(r["model"], r["batch"]) for r in rows}, key=key)
    for model, batch in keys:
        got = {r["method"]: r for r in rows if (r["model"], r["batch"]) == (model, batch)}
        any_row = next(iter(got.values()))
        count = f"{any_row['materialised']} ({any_row['materialised_params']:,} params)"
        reason = any_row["first_materialised"].replace("|", "\\|") or "-"
        lines.append(f"| {model}, {batch} | " + " | ".join([*cells(got), count, reason]) + " |")
    return "\n".join(lines)


def beside(first: list[dict], second: list[dict], names: tuple[str, str]) -> str:
    """Two runs of the same models and batches side by side (`names`: what each ran under):
    per model and batch, ``clipped_grad``'s memory and time in each, as ratios to the
    non-private step of its own run."""
    heads = " | ".join(f"{what}, {name}" for what in ("memory", "time") for name in names)
    lines = [f"| model, batch | {heads} |", "|---" * 5 + "|"]
    ghost = [
        {(r["model"], r["batch"]): r for r in rows if r["method"] == GHOST}
        for rows in (first, second)
    ]
    if ghost[0].keys() != ghost[1].keys():
        only = [
            sorted(f"{m}, {b}" for m, b in a.keys() - b.keys()) for a, b in (ghost, ghost[::-1])
        ]
        raise ValueError(
            "the two runs measured other models or batches: only in the first "
            f"{only[0] or 'none'}, only in the second {only[1] or 'none'}"
        )
    for model, batch in ghost[0]:
        a, b = (g[model, batch] for g in ghost)
        cells_ = [ratio(a["peak_ratio"]), ratio(b["peak_ratio"])]
        cells_ += [ratio(a["time_ratio"]), ratio(b["time_ratio"])]
        lines.append(f"| {model}, {batch} | " + " | ".join(cells_) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(
        parser, MODELS, quick="batch 16 and T=8 (a smoke test)", only="models", several=True
    )
    parser.add_argument(
        "--markdown", type=pathlib.Path, default=None, help="print a --json file's table"
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths")
    parser.add_argument(
        "--beside",
        type=pathlib.Path,
        default=None,
        help="with --markdown: a second saved run, printed beside the first",
    )
    args = parser.parse_args(argv)
    args.pairs = args.pairs or (2 if args.quick else 5)
    if args.beside and not args.markdown:
        parser.error("--beside prints beside a --markdown file")
    for name, path in (("--markdown", args.markdown), ("--beside", args.beside)):
        if path is not None and not path.is_file():
            parser.error(f"{name}: no saved run at {path}")
    if args.markdown:
        rows = load_rows(args.markdown)
        if args.beside:
            print(beside(rows, load_rows(args.beside), (flags(args.markdown), flags(args.beside))))
        else:
            print(markdown(rows))
        return rows
    shape, batches = (Shape(seq=8), (16,)) if args.quick else (Shape(), (32, 64, 128))
    batches = tuple(args.batches) if args.batches else batches
    announce("recurrent private training benchmark", args.quick)
    rows = []
    for seq in args.seqs or [shape.seq]:
        named = args.seqs is not None
        for name, (loss, params, make_batch) in setups(dataclasses.replace(shape, seq=seq)).items():
            if (args.only and name not in args.only) or (
                named and name == "eqx-convnet" and seq != args.seqs[0]
            ):
                continue
            label = f"{name} T={seq}" if named and name != "eqx-convnet" else name
            print(f"{label}: {_private_models.parameter_count(params):,} parameters", flush=True)
            for b in batches:
                batch = make_batch(b)
                report = materialised(loss, params, batch)
                got = measure(label, loss, params, batch, b, args)
                rows += [{**row, **report} for row in got]
    print(table(rows))
    print()
    print(markdown(rows))
    if args.json:
        save_run(args.json, rows, f"{where()}, jax {jax.__version__}")
    assert all(math.isfinite(r["peak_bytes"]) for r in rows)
    return rows


if __name__ == "__main__":
    main()
