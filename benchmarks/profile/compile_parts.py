"""Where the ghost step's compile goes on a deep MLP: the step written out part by part.

    python benchmarks/profile/compile_parts.py [--only mlp-4 mlp-24] [--repeats 3]
                                               [--json out.json]

On ``compile.py``'s MLPs (ReLU layers of width 64, batch 16), the ghost step's parts are
written out here with the engine's own functions, layer by layer as the engine takes them, and
each program below is traced, lowered and compiled beside the non-private step:

* ``tapped pass``: the forward and backward pass to each dense layer's input (its record) and
  the gradient of its output (its tap), as the engine's tapped pass gives them;
* ``+ norms``: and each example's norm: every record and output gradient normalized
  (`_interpret.exponents_of`, `_interpret.scaled`), each layer's terms (its kernel's and its
  bias's) added at their largest exponent (`_norms.combine`);
* ``+ sums, not normalized``: and the clipped sums ``A^T (w G)`` from the records and output
  gradients as they are (wrong where a factor leaves float32's range);
* ``+ sums, normalized``: the clipped sums as the engine takes them: each example's factor
  times the powers of two its record and output gradient were divided by (`_sums.scaled`),
  on the normalized copies;
* ``nothing normalized``: norms and sums from the records and output gradients as they are
  (wrong where a square leaves float32's range);
* ``layers stacked``: the 64-by-64 layers' records and output gradients stacked, normalized
  once, their norms' terms one array and their sums one batched product, returned stacked;
* ``layers stacked, split``: the same, its sums split into the layers' leaves, as a step must
  return them;
* ``norms stacked``: the norms as ``layers stacked`` takes them, the sums layer by layer as
  ``+ sums, normalized`` does (each layer's record and output gradient normalized again);
* ``optclip.clipped_grad``: the engine itself.

Each row: the medians over ``--repeats`` rounds (the programs' order rotated from round to
round) of the seconds to trace and lower a fresh jitted program (``compile.measure_once``'s
way: JAX's caches cleared, a new closure), to compile it, and their sum; the median ratio of
that sum to the non-private step's in the same round; the fusions the compiled program calls
and how many of them differ (their computations compared with names and metadata dropped: XLA
compiles a kernel the program already holds once); and the largest relative difference of its
norms and clipped sums (those it computes) from a float64 NumPy reference built from the same
records and output gradients (``optclip.clipped_grad``'s sums against the reference of its
own tapped pass). A diagnostic, not a contract.
"""

from __future__ import annotations

import argparse
import collections
import gc
import pathlib
import re
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import _private_models as models  # noqa: E402
import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from compile import BATCH, MODELS, machine, maker, warm_up  # noqa: E402
from private import CLIP, GHOST, NON_PRIVATE, save_run  # noqa: E402

from optclip.per_example.ghost import _interpret, _norms, _sums  # noqa: E402

MLPS = [name for name in MODELS if name.startswith("mlp-")]
TAPS = "tapped pass"
NORMS = "+ norms"
RAW_SUMS = "+ sums, not normalized"
SUMS = "+ sums, normalized"
RAW = "nothing normalized"
STACKED = "layers stacked"
SPLIT = "layers stacked, split"
NORMS_STACKED = "norms stacked"
PARTS = (TAPS, NORMS, RAW_SUMS, SUMS, RAW, STACKED, SPLIT, NORMS_STACKED)
VARIANTS = (NON_PRIVATE, *PARTS, GHOST)


def tapped(params, batch):
    """Each dense layer's input and its output's gradient, per example: ``(records, grads)``,
    lists of ``(B, features)``."""
    layers = len(params)

    def total(taps):
        x, labels = batch
        records = []
        for i in range(layers):
            layer = params[f"dense{i}"]
            records.append(x)
            x = x @ layer["kernel"] + layer["bias"] + taps[i]
            if i < layers - 1:
                x = jax.nn.relu(x)
        logp = jax.nn.log_softmax(x, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, labels[:, None], axis=-1)), records

    taps = [jnp.zeros((batch[0].shape[0], params[f"dense{i}"]["bias"].size)) for i in range(layers)]
    grads, records = jax.grad(total, has_aux=True)(taps)
    return records, grads


def weights(norms):
    """Each example's factor ``min(1, C / norm)``."""
    return jnp.where(norms > CLIP, CLIP / norms, 1.0)


def _terms(r, g, er, eg):
    """A layer's norm terms, its kernel's and its bias's, from its normalized record and output
    gradient (laid out ``(*layers, B, features)``)."""
    squares = lambda x: jnp.sum(x * x, axis=-1).reshape(-1, x.shape[-2])  # noqa: E731
    at = lambda e: e.reshape(-1, e.shape[-1])  # noqa: E731
    return [(squares(r) * squares(g), at(2 * (er + eg))), (squares(g), at(2 * eg))]


def _normalized(records, grads, axis):
    out = []
    for r, g in zip(records, grads, strict=True):
        er, eg = _interpret.exponents_of(r, axis), _interpret.exponents_of(g, axis)
        out.append((_interpret.scaled(r, er), _interpret.scaled(g, eg), er, eg))
    return out


def _norms_of(normalized):
    terms = [t for r, g, er, eg in normalized for t in _terms(r, g, er, eg)]
    flagged = _norms._flagged([e for *_, er, eg in normalized for e in (er, eg)])
    return _norms.combine(terms, flagged, jnp.float32)


def _sums_of(normalized, w):
    """Each layer's clipped kernel and bias sums, the engine's way (see the module)."""
    out = []
    for r, g, er, eg in normalized:
        lead = (1,) * (r.ndim - 2)  # (a stack's layers)
        kernel = _sums.scaled(w.reshape(*lead, -1), er + eg)
        bias = _sums.scaled(w.reshape(*lead, -1), eg)
        out.append(
            (
                jnp.einsum("...bi,...bj->...ij", r, g * kernel[..., None]),
                jnp.einsum("...bj,...b->...j", g, bias),
            )
        )
    return out


def part(variant: str):
    """The program of `variant` (see the module): ``(params, batch) -> (norms, sums)``, the
    sums a list of ``(kernel, bias)`` per layer (None where it computes none)."""

    def program(params, batch):
        records, grads = tapped(params, batch)
        if variant == TAPS:
            return None, list(zip(records, grads, strict=True))
        if variant == RAW:
            squares = lambda x: jnp.sum(x * x, axis=-1)  # noqa: E731
            norms = jnp.sqrt(sum(squares(g) * (squares(r) + 1) for r, g in zip(records, grads)))
            w = weights(norms)
            return norms, [(r.T @ (g * w[:, None]), g.T @ w) for r, g in zip(records, grads)]
        if variant in (STACKED, SPLIT, NORMS_STACKED):  # (all but the last layer: 64 by 64)
            stacked = _normalized([jnp.stack(records[:-1])], [jnp.stack(grads[:-1])], 1)
            normalized = stacked + _normalized(records[-1:], grads[-1:], 0)
            norms = _norms_of(normalized)
            if variant == NORMS_STACKED:
                return norms, _sums_of(_normalized(records, grads, 0), weights(norms))
            (kernels, biases), last = _sums_of(normalized, weights(norms))
            if variant == STACKED:
                return norms, [(kernels, biases), last]
            return norms, [*zip(list(kernels), list(biases), strict=True), last]
        normalized = _normalized(records, grads, 0)
        norms = _norms_of(normalized)
        if variant == NORMS:
            return norms, None
        w = weights(norms)
        if variant == RAW_SUMS:
            return norms, [(r.T @ (g * w[:, None]), g.T @ w) for r, g in zip(records, grads)]
        return norms, _sums_of(normalized, w)

    return program


def reference(params, batch):
    """Float64 norms and clipped sums from the tapped pass's records and output gradients:
    ``(norms, [(kernel, bias)])``."""
    records, grads = jax.jit(tapped)(params, batch)
    records = [np.asarray(r, np.float64) for r in records]
    grads = [np.asarray(g, np.float64) for g in grads]
    squares = lambda x: np.sum(x * x, axis=-1)  # noqa: E731
    norms = np.sqrt(sum(squares(g) * (squares(r) + 1) for r, g in zip(records, grads)))
    w = np.minimum(1.0, CLIP / norms)
    return norms, [(r.T @ (g * w[:, None]), g.T @ w) for r, g in zip(records, grads)]


def error(variant: str, got, want) -> float:
    """The largest relative difference of `got` from `want`, each array against its own
    largest magnitude (0 for the tapped pass, which computes neither)."""
    relative = lambda a, b: float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))  # noqa: E731
    if variant == TAPS:
        return 0.0
    if variant == GHOST:  # (the engine's step: its sums, leaf by leaf)
        pairs = [(got[f"dense{i}"]["kernel"], got[f"dense{i}"]["bias"]) for i in range(len(got))]
        return max(
            relative(a, b)
            for p, q in zip(pairs, want[1], strict=True)
            for a, b in zip(p, q, strict=True)
        )
    norms, sums = got
    out = [relative(norms, want[0])]
    if sums is not None:
        flat = [a for pair in sums for a in pair]
        if variant == STACKED:  # (the stacked layers, then the last)
            flat = [*flat[0], *flat[1], flat[2], flat[3]]
            want_flat = [k for k, _ in want[1][:-1]] + [b for _, b in want[1][:-1]]
            want_flat += list(want[1][-1])
        else:
            want_flat = [a for pair in want[1] for a in pair]
        out += [relative(a, b) for a, b in zip(flat, want_flat, strict=True)]
    return max(out)


def _fusions(compiled) -> tuple[int, int]:
    """The fusions `compiled`'s entry computation calls, and how many of them differ."""
    text = compiled.as_text()
    bodies = {}
    for block in text.split("\n\n"):
        if m := re.match(r"\s*%(\S+) ", block):
            bodies[m[1]] = block
    entry = text[text.index("ENTRY") :]
    called = re.findall(r"fusion\(.*?calls=%([^,\s]+)", entry)

    def plain(body: str) -> str:
        body = re.sub(r", metadata=\{[^}]*\}", "", body)
        return re.sub(r"%[\w\-.]+", "%x", body.split("\n", 1)[-1])

    return len(called), len({plain(bodies.get(c, c)) for c in called})


def makers(name: str):
    """``({variant: make}, params, batch)`` for model `name`: each `make` returns a new
    function on every call (no cache keyed on it answers)."""
    _, setup = MODELS[name]
    loss, params, batch = setup()
    n = models.parameter_count(params)
    out = {method: maker(loss, method, n) for method in (NON_PRIVATE, GHOST)}
    for variant in PARTS:
        program = part(variant)
        out[variant] = lambda program=program: lambda p, b: program(p, b)  # (a new closure)
    return out, params, batch


def measure_once(make, params, batch) -> dict:
    jax.clear_caches()
    gc.collect()
    jitted = jax.jit(make())
    start = time.perf_counter()
    lowered = jitted.trace(params, batch).lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    fusions, distinct = _fusions(compiled)
    return {
        "trace_lower_s": lowered_at - start,
        "compile_s": done - lowered_at,
        "total_s": done - start,
        "fusions": fusions,
        "distinct": distinct,
        "out": compiled(params, batch),
    }


def measure(name: str, repeats: int) -> list[dict]:
    make, params, batch = makers(name)
    want = reference(params, batch)
    got: dict = collections.defaultdict(list)
    for order in _timing.rotated_orders(len(VARIANTS), repeats):
        for k in order:
            got[VARIANTS[k]].append(measure_once(make[VARIANTS[k]], params, batch))
    rows = []
    plain = [s["total_s"] for s in got[NON_PRIVATE]]
    for variant in VARIANTS:
        samples = got[variant]
        row = dict(model=name, variant=variant, batch=BATCH, repeats=repeats)
        for key in ("trace_lower_s", "compile_s", "total_s"):
            row[key] = statistics.median(s[key] for s in samples)
        row["total_ratio"] = statistics.median(
            s["total_s"] / p for s, p in zip(samples, plain, strict=True)
        )
        row["fusions"], row["distinct"] = samples[-1]["fusions"], samples[-1]["distinct"]
        out = samples[-1]["out"]
        row["error"] = 0.0 if variant == NON_PRIVATE else error(variant, out, want)
        rows.append(row)
        print(
            f"{name}: {variant}: trace+lower {row['trace_lower_s']:.3f} s, compile "
            f"{row['compile_s']:.3f} s ({row['total_ratio']:.2f}x), {row['fusions']} fusions "
            f"({row['distinct']} distinct), error {row['error']:.1e}",
            flush=True,
        )
    return rows


def markdown(rows) -> str:
    lines = [
        "| model | program | trace+lower s | compile s | x plain | fusions | distinct |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['trace_lower_s']:.3f} | {r['compile_s']:.3f} "
            f"| {r['total_ratio']:.2f}x | {r['fusions']} | {r['distinct']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=MLPS, default=MLPS, metavar="NAME")
    parser.add_argument("--repeats", type=_timing.count, default=3, help="rounds (default 3)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    where = machine()
    print(f"compile parts: jax {where['jax']}, {where['cores']} cores ({where['processor']})")
    warm_up()
    rows = [row for name in args.only for row in measure(name, args.repeats)]
    print()
    print(markdown(rows))
    if args.json:
        save_run(args.json, rows, f"{where['cores']}-core {where['device']}, jax {where['jax']}")
    return rows


if __name__ == "__main__":
    main()
