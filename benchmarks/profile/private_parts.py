"""Where the ghost step's time goes: the step with one of its parts taken out.

    python benchmarks/profile/private_parts.py [--quick] [--batches 128 256] [--pairs 3]
        [--json out] [--variants ghost 'norms batched' ...]
    python benchmarks/profile/private_parts.py --grams [--batches 256]
    python benchmarks/profile/private_parts.py --mlp [--batches 256] [--pairs 20]
    python benchmarks/profile/private_parts.py --convnet [--batches 16 64] [--pairs 15]
    python benchmarks/profile/private_parts.py --recurrent eqx-gru [--seq 64] [--batches 64]
        [--pairs 15]
    python benchmarks/profile/private_parts.py --products [--batches 256] [--pairs 20]
    python benchmarks/profile/private_parts.py --flops [--mlp] [--batches 16 256]
    python benchmarks/profile/private_parts.py --memory [--mlp | --convnet] [--gpu-branches]
        [--batches 16 64 256]
        [--dtype bfloat16]
    python benchmarks/profile/private_parts.py --kernels [--mlp] [--batches 256] [--top 30]
    python benchmarks/profile/private_parts.py --faults --recurrent flax-lstm --seq 16
        [--batches 256] [--variants ghost]

On the transformer of `benchmarks/private.py` (d=256, T=128, vocabulary 8192, 4 scanned blocks),
side by side in one process (interleaved medians, ratios to the non-private step):

* ``ghost``: ``optclip.clipped_grad`` as it is;
* ``norms at 1``: every per-example norm replaced by 1 (no Grams, no magnitudes): the step
  less its norms;
* ``sums of 0``: the clipped sums replaced by zeros (no book-keeping products): the step less
  its clipped sums, the tapped pass and the norms left;
* ``tapped pass only``: both, the norms of 1 read from one entry of every record and output
  gradient (times 0) so that XLA keeps the tapped pass whole: the step less its norms and
  sums;
* ``Grams only``: every ghost leaf's norm by its Grams (`force_ghost_route("grams")`), never
  by its direct product;
* ``direct products``: every ghost leaf of one use by its direct product
  (`force_ghost_route("direct")`);
* ``norms one example at a time``: the norms in a loop over the examples on a CPU whatever
  the size of their Grams (`_norms.LOOP_WORK` of 0);
* ``norms batched``: the norms over the whole batch at once on every platform;
* ``output gradients unpinned``: the output gradients at the tapped sites left to XLA's
  layout assignment (`_interpret.in_row_major` as the identity: on a GPU a scanned layer's
  gradients were otherwise laid out for its bias's per-example sum);
* ``output gradients all pinned``: every tapped output gradient held row-major, the outputs
  of Equinox's ``W @ x`` products included (`_shared.weight_first` false for every site);
* ``Grams at HIGHEST``: the Grams at HIGHEST precision, where they otherwise follow their
  products' (`_factors.product_precision`: at JAX's default on a GPU, TF32). On a CPU, where
  float32 products are float32 at every precision, the same step as ``ghost``;
* ``convolutions' sums together``: the convolutions' clipped sums in one program on a CPU,
  where they otherwise go one after another (`_sums.in_turn`). On a model with fewer than
  two convolved leaves whose route is not ``PRODUCT``, the same step as ``ghost``;
* ``convolutions' products not formed``: no leaf's per-example gradient formed in the tapped
  pass (`_norms.products` giving none): a ``PRODUCT`` convolution's norm from its patches'
  direct product, its clipped sum from its output gradient, as every ``DIRECT`` leaf's. On a
  model with no ``PRODUCT`` leaf, the same step as ``ghost``;
* ``scans' steps kept whole``: every value a scan's step computes kept for the backward pass
  (`_interpret.SCAN_SAVES` saving everything), where the engine keeps the values its sites'
  output gradients are taken at and its other products' outputs, and computes the rest again.
  On a model with no scan, the same step as ``ghost``;
* ``scans' products kept``: a scan's step keeps every product's output (JAX's
  ``dots_saveable`` as `_interpret.SCAN_SAVES`), the tapped sites' included, and computes the
  rest again. On a model with no scan, the same step as ``ghost``;
* ``scans' repeated stacks kept``: the tapped pass as JAX's partial evaluation writes it, a
  scan's value that is both a site's record and a residual of its backward pass stacked twice
  (`_repeats.merged` as the identity; a GRU's state). On a model where no scan writes a value
  twice, the same step as ``ghost``.

The parts are swapped in by replacing names of the ghost engine (`_norms.norms`,
`_sums.clipped`, `_plans.forced`, `_norms.LOOP_WORK`, `_interpret.in_row_major`,
`_shared.weight_first`, `_factors.product_precision`, `_sums.in_turn`, `_norms.products`,
`_interpret.SCAN_SAVES`, `_repeats.merged`) while each step is traced; each variant's norms
are checked to be what it says (1 where the norms are replaced). A diagnostic, not a
contract.

``--mlp`` does the same on the benchmark's 784-512-512-10 MLP (at batch 256 by default), whose
steps take milliseconds: each round then calls a step until the round takes 50 ms.
``--convnet`` on its depthwise-separable network (``private.py --only convnet``; at batches 16
and 64 by default).

``--products`` times the MLP's first layer's clipped sum ``A^T (w G)`` (records ``(B, 1,
784)``, output gradients ``(B, 1, 512)``) three ways: the non-private step's ``A^T G``, JAX's
VJP of the batched equation (it transposes its product) and the engine's written-out product
(`_products.dense_view_sum`).

``--flops`` counts, in place of timing, each step's matrix products' floating-point operations
(2 per multiply-add of every `dot_general` in its jaxpr: a scan's body as many times as it
runs, a `cond`'s cheapest branch, calls and rematerialised blocks walked into; elementwise
work not counted): the arithmetic each variant must do, whatever the machine.

``--memory``, in place of timing, gives each step's peak memory by XLA's analysis of it
compiled for this machine (`private.peak_bytes`, as ``benchmarks/private.py`` measures it).
``--gpu-branches`` builds the steps (timed, counted or sized) with the engine's
`lax.platform_dependent` choice made as on a GPU: what a GPU would run, compiled for this
machine, an estimate of a GPU's step where none is lent (its memory is packed by the CPU's
scheduler, not the GPU's).

``--recurrent NAME`` does the same on a model of ``benchmarks/recurrent.py`` (``eqx-gru``,
``eqx-lstm-lm``, ``flax-lstm``, ``jax-lstm``, ``hk-deeprnn``, ``eqx-convnet``; at batch 64 by
default, and at ``--seq`` steps where given).

``--dtype bfloat16`` (or ``float16``) casts the model's parameters and floating-point inputs
(timed, counted, sized or profiled; not with ``--grams`` or ``--products``): the ghost engine
adds such leaves' sums in float32, and XLA on a CPU computes their products in float32.

``--kernels`` profiles the non-private step and the ghost step (`_kernels.by_line`: device
time per call by the source line of each HLO instruction, a GPU's kernels summed per
instruction) and prints the `--top` lines whose time differs most between them: the model's
own lines (the tapped pass against the ordinary backward pass) beside the engine's.

``--faults``, in place of timing, counts each step's minor page faults per call (the
process's, `resource.getrusage`, over ``--pairs`` calls after two, each run to its end) beside
the temporaries XLA's analysis gives it (`temp_size_in_bytes`). XLA's CPU runtime allocates a
step's temporaries at every call, and a page the allocator maps afresh faults when the step
first writes it: on a CPU, that time is part of the step's. POSIX only (`resource`).

``--grams`` times the output layer's per-example Gram ``G G^T`` (``(B, T, V)``, at JAX's
default precision, as the engine computes it for a product at that precision) three ways:
one batched product (what the engine does), the two halves of its rows apart (the Gram is
symmetric: three of its four blocks), and one example at a time (`lax.map`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder's helpers, then benchmarks/'s
import _kernels  # noqa: E402
import _private_models as models  # noqa: E402
import _timing  # noqa: E402
import private  # noqa: E402

import optclip  # noqa: E402
from optclip.per_example import _clips  # noqa: E402
from optclip.per_example.ghost import (  # noqa: E402
    _factors,
    _interpret,
    _norms,
    _plans,
    _products,
    _repeats,
    _shared,
    _sums,
)
from optclip.per_example.ghost._target import Target  # noqa: E402

CLIP = 1.0
HIGHEST = lax.Precision.HIGHEST


def _norms_at_one(plans, t, target):
    return jnp.ones((t.size,), _norms.accumulation(t))


def _norms_read_once(plans, t, target):
    """1 for every example, read from one entry of every record and output gradient (times
    0): XLA keeps the tapped pass whole, where norms of 1 alone leave nothing to compute."""
    first = [
        jnp.ravel(x)[0].astype(jnp.float32)
        for x in jax.tree.leaves((t.records, t.grads))
        if jnp.issubdtype(x.dtype, jnp.floating) and x.size
    ]
    return _norms_at_one(plans, t, target) + 0 * sum(first)


def _sums_of_zero(plans, t, w, keep, target, axis=None):
    return [jnp.zeros_like(leaf, _clips._work_dtype(leaf.dtype)) for leaf in t.leaves]


def _together(items, step, carried):
    return functools.reduce(lambda c, item: step(item, c), items, carried)


VARIANTS = {
    "ghost": {},
    "norms at 1": {"norms": _norms_at_one},
    "sums of 0": {"clipped": _sums_of_zero},
    "tapped pass only": {"norms": _norms_read_once, "clipped": _sums_of_zero},
    "Grams only": {"forced": lambda: "grams"},
    "direct products": {"forced": lambda: "direct"},
    "norms one example at a time": {"LOOP_WORK": 0},
    "norms batched": {"LOOP_WORK": 2**62},
    "output gradients unpinned": {"in_row_major": lambda g: g},
    "output gradients all pinned": {"weight_first": lambda site: False},
    "Grams at HIGHEST": {"product_precision": lambda precision: HIGHEST},
    "convolutions' sums together": {"in_turn": _together},
    "convolutions' products not formed": {"products": lambda plans, t: {}},
    "scans' steps kept whole": {"SCAN_SAVES": jax.checkpoint_policies.everything_saveable},
    "scans' products kept": {"SCAN_SAVES": jax.checkpoint_policies.dots_saveable},
    "scans' repeated stacks kept": {"merged": lambda f: f},
}
_MODULES = {
    "norms": _norms,
    "clipped": _sums,
    "forced": _plans,
    "LOOP_WORK": _norms,
    "in_row_major": _interpret,
    "weight_first": _shared,
    "product_precision": _factors,
    "in_turn": _sums,
    "products": _norms,
    "SCAN_SAVES": _interpret,
    "merged": _repeats,
}


@contextlib.contextmanager
def swapped(names: dict):
    """The engine with the names in `names` replaced, for tracing."""
    saved = {name: getattr(_MODULES[name], name) for name in names}
    try:
        for name, value in names.items():
            setattr(_MODULES[name], name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(_MODULES[name], name, value)


def _inner_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jcore.Jaxpr):
                yield item


def dot_flops(jaxpr, times: int = 1) -> int:
    """2 per multiply-add of `jaxpr`'s `dot_general`s, run `times` times: a scan's body counted
    as often as it runs, a `cond`'s cheapest branch, calls and rematerialised blocks walked
    into."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            shape = eqn.invars[0].aval.shape
            k = math.prod(shape[i] for i in contracted)
            total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * k
            continue
        inner = list(_inner_jaxprs(eqn))
        if eqn.primitive.name == "cond":
            total += min(dot_flops(j, times) for j in inner)
        else:
            runs = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            total += sum(dot_flops(j, times * runs) for j in inner)
    return total


def flops(loss, params, batch, variants=tuple(VARIANTS)) -> list[dict]:
    """`dot_flops` of the non-private step and of each of `variants`."""
    size = jax.tree.leaves(batch)[0].shape[0]
    base = dot_flops(jax.make_jaxpr(_non_private(loss, size))(params, batch).jaxpr)
    rows = [dict(variant="jax.grad (non-private)", batch=size, flops=base)]
    for name in variants:
        names = VARIANTS[name]
        step = optclip.clipped_grad(loss, l2_clip_norm=CLIP)
        with swapped(names):
            count = dot_flops(jax.make_jaxpr(step)(params, batch).jaxpr)
        rows.append(dict(variant=name, batch=size, flops=count, flop_ratio=count / base))
    return rows


def _non_private(loss, size: int):
    def non_private(p, b):
        return jax.grad(lambda q: loss(q, b) * size)(p)

    return non_private


def parts(loss, params, batch, pairs: int, variants=tuple(VARIANTS)) -> list[dict]:
    size = jax.tree.leaves(batch)[0].shape[0]
    steps = [jax.jit(_non_private(loss, size)).lower(params, batch).compile()]
    for name in variants:
        names = VARIANTS[name]
        step = optclip.clipped_grad(loss, l2_clip_norm=CLIP, return_grad_norms=True)
        with swapped(names):
            steps.append(jax.jit(step).lower(params, batch).compile())
        norms = np.asarray(steps[-1](params, batch)[1].grad_norms)
        if "norms" in names:
            assert np.allclose(norms, 1.0), norms
        else:
            assert np.all(norms > 0) and not np.allclose(norms, 1.0), norms
    runners = [functools.partial(step, params, batch) for step in steps]
    paired = _timing.interleaved(runners, pairs=pairs, warmup=1, min_sample_s=0.05)
    rows = [dict(variant="jax.grad (non-private)", batch=size, time_s=paired.medians[0])]
    for k, name in enumerate(variants, 1):
        rows.append(
            dict(
                variant=name,
                batch=size,
                time_s=paired.medians[k],
                time_ratio=paired.ratio(k, 0),
                time_iqr=paired.spread(k, 0),
            )
        )
    return rows


def memory(loss, params, batch, variants=tuple(VARIANTS)) -> list[dict]:
    """The peak memory of the non-private step and of each of `variants`, by XLA's analysis of
    each compiled for this machine (`private.peak_bytes`), untimed."""
    size = jax.tree.leaves(batch)[0].shape[0]
    compiled = lambda f: jax.jit(f).lower(params, batch).compile()  # noqa: E731
    base = private.peak_bytes(compiled(_non_private(loss, size)))
    rows = [dict(variant="jax.grad (non-private)", batch=size, peak_bytes=base)]
    for name in variants:
        with swapped(VARIANTS[name]):
            peak = private.peak_bytes(compiled(optclip.clipped_grad(loss, l2_clip_norm=CLIP)))
        rows.append(dict(variant=name, batch=size, peak_bytes=peak, memory_ratio=peak / base))
    return rows


def faults_counted() -> bool:
    """Whether this platform counts a process's page faults (`resource`, POSIX)."""
    import importlib.util

    return importlib.util.find_spec("resource") is not None


def faults(loss, params, batch, calls: int, variants=tuple(VARIANTS)) -> list[dict]:
    """The minor page faults per call of the non-private step and of each of `variants`
    (`resource.getrusage` over `calls` calls after two), and each one's temporaries by XLA's
    analysis of it compiled for this machine, untimed."""
    import resource

    size = jax.tree.leaves(batch)[0].shape[0]
    page = resource.getpagesize()

    def counted(f) -> dict:
        compiled = jax.jit(f).lower(params, batch).compile()
        for _ in range(2):
            jax.block_until_ready(compiled(params, batch))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(calls):
            jax.block_until_ready(compiled(params, batch))
        count = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
        temp = compiled.memory_analysis().temp_size_in_bytes
        return dict(batch=size, faults=count, faulted_bytes=count * page, temp_bytes=temp)

    rows = [dict(variant="jax.grad (non-private)", **counted(_non_private(loss, size)))]
    for name in variants:
        with swapped(VARIANTS[name]):
            rows.append(
                dict(variant=name, **counted(optclip.clipped_grad(loss, l2_clip_norm=CLIP)))
            )
    return rows


@contextlib.contextmanager
def gpu_branches():
    """The engine's `lax.platform_dependent` choices made as on a GPU (their default branch)
    whatever machine the steps are compiled for: what a GPU would run, compiled here."""
    chosen = lax.platform_dependent
    lax.platform_dependent = lambda *args, default, **_: default(*args)
    try:
        yield
    finally:
        lax.platform_dependent = chosen


def kernels(loss, params, batch, top: int) -> list[dict]:
    size = jax.tree.leaves(batch)[0].shape[0]
    steps = {
        "non-private": jax.jit(_non_private(loss, size)),
        "ghost": jax.jit(optclip.clipped_grad(loss, l2_clip_norm=CLIP)),
    }
    times = {
        name: _kernels.by_line(step.lower(params, batch).compile(), (params, batch), calls=5)
        for name, step in steps.items()
    }
    plain, ghost = times["non-private"], times["ghost"]
    rows = [
        dict(line=line, batch=size, ghost_s=ghost.get(line, 0.0), plain_s=plain.get(line, 0.0))
        for line in set(plain) | set(ghost)
    ]
    rows.sort(key=lambda r: -abs(r["ghost_s"] - r["plain_s"]))
    total = dict(line="(all)", batch=size, ghost_s=sum(ghost.values()), plain_s=sum(plain.values()))
    return [total, *rows[:top]]


def grams(batch: int, shape: models.TransformerShape, pairs: int) -> list[dict]:
    g = jax.random.normal(jax.random.key(0), (batch, shape.seq, shape.vocab))
    half = shape.seq // 2

    def gram(a, b):
        return jnp.einsum("bks,bjs->bkj", a, b)

    def batched(g):
        return jnp.sum(jnp.square(gram(g, g)), axis=(1, 2))

    def halves(g):
        a, b = g[:, :half], g[:, half:]
        blocks = [(gram(a, a), 1), (gram(a, b), 2), (gram(b, b), 1)]
        return sum(c * jnp.sum(jnp.square(p), axis=(1, 2)) for p, c in blocks)

    def one_by_one(g):
        return lax.map(lambda x: jnp.sum(jnp.square(gram(x[None], x[None]))), g)

    ways = {
        "one batched product": batched,
        "two halves": halves,
        "one example at a time": one_by_one,
    }
    fns = {name: jax.jit(f).lower(g).compile() for name, f in ways.items()}
    reference = np.asarray(fns["one batched product"](g))
    for f in fns.values():
        np.testing.assert_allclose(np.asarray(f(g)), reference, rtol=1e-5)
    paired = _timing.interleaved(
        [functools.partial(f, g) for f in fns.values()], pairs=pairs, warmup=1, min_sample_s=0.0
    )
    return [
        dict(way=name, batch=batch, time_s=paired.medians[k], time_ratio=paired.ratio(k, 0))
        for k, name in enumerate(ways)
    ]


def products(batch: int, shape: models.MLPShape, pairs: int) -> list[dict]:
    """The MLP's first layer's clipped sum ``A^T (w G)`` three ways, from its records
    ``(B, 1, inputs)`` and output gradients ``(B, 1, hidden)``."""
    key_a, key_g, key_w = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(key_a, (batch, 1, shape.inputs))
    g = jax.random.normal(key_g, (batch, 1, shape.hidden))
    w = jax.random.uniform(key_w, (batch,))
    kernel = jnp.zeros((shape.inputs, shape.hidden))
    eqn = jax.make_jaxpr(lambda x, k: x @ k)(a[0], kernel).jaxpr.eqns[0]
    site = types.SimpleNamespace(eqn=eqn, views=((1, None),))  # (what the sum reads)
    target = Target(cpu=jax.default_backend() == "cpu")

    def plain(a, g, w):  # the non-private step's product (no factors)
        return lax.dot_general(a[:, 0], g[:, 0], (([0], [0]), ([], [])))

    def vjp(a, g, w):  # JAX's VJP of the batched equation
        f = jax.vmap(lambda x, k: x @ k, in_axes=(0, None))
        return jax.vjp(lambda k: f(a, k), kernel)[1](g * w[:, None, None])[0]

    def written_out(a, g, w):
        return _products.dense_view_sum(site, kernel, a, g * w[:, None, None], target, 0)

    ways = {"A^T G (non-private)": plain, "VJP of the batch": vjp, "written out": written_out}
    fns = {name: jax.jit(f).lower(a, g, w).compile() for name, f in ways.items()}
    reference = np.asarray(fns["VJP of the batch"](a, g, w))
    np.testing.assert_allclose(np.asarray(fns["written out"](a, g, w)), reference, rtol=1e-5)
    paired = _timing.interleaved(
        [functools.partial(f, a, g, w) for f in fns.values()],
        pairs=pairs,
        warmup=1,
        min_sample_s=0.05,
    )
    return [
        dict(way=name, batch=batch, time_s=paired.medians[k], time_ratio=paired.ratio(k, 0))
        for k, name in enumerate(ways)
    ]


def _cast_batches(make_batch, dtype):
    """`make_batch` whose batches' floating-point inputs are in `dtype`."""
    return lambda size: models.cast(make_batch(size), dtype)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny transformer")
    parser.add_argument("--batches", type=_timing.count, nargs="+", default=None)
    parser.add_argument(
        "--pairs", type=_timing.count, default=None, help="timing rounds (default 3)"
    )
    parser.add_argument("--grams", action="store_true", help="the output layer's Gram, 3 ways")
    parser.add_argument("--mlp", action="store_true", help="the MLP in place of the transformer")
    parser.add_argument(
        "--convnet", action="store_true", help="the convnet in place of the transformer"
    )
    parser.add_argument(
        "--recurrent",
        choices=models.RECURRENT_MODELS,
        default=None,
        help="a model of benchmarks/recurrent.py in place of the transformer",
    )
    parser.add_argument(
        "--seq",
        type=_timing.count,
        default=None,
        help="the --recurrent model's sequence length (default: recurrent.py's, 32)",
    )
    parser.add_argument(
        "--products", action="store_true", help="the MLP's first clipped-sum product, 3 ways"
    )
    parser.add_argument(
        "--flops", action="store_true", help="each variant's matrix-product operations, untimed"
    )
    parser.add_argument(
        "--kernels", action="store_true", help="device time by source line, profiled"
    )
    parser.add_argument("--top", type=_timing.count, default=30, help="lines --kernels prints")
    parser.add_argument(
        "--memory", action="store_true", help="each variant's compiled peak memory, untimed"
    )
    parser.add_argument(
        "--faults",
        action="store_true",
        help="each variant's page faults per call and its temporaries, untimed",
    )
    parser.add_argument(
        "--gpu-branches",
        action="store_true",
        help="the engine's platform choices made as on a GPU, compiled for this machine",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        metavar="NAME",
        help="the variants timed or counted, by name (default: all)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the model's parameters and inputs in this dtype (default float32)",
    )
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.dtype != "float32" and (args.grams or args.products):
        parser.error("--dtype casts the benchmark's model: not with --grams or --products")
    if args.kernels and (args.flops or args.memory or args.grams or args.products):
        parser.error(
            "--kernels profiles the two steps: not with --flops, --memory, --grams or --products"
        )
    if args.flops and (args.memory or args.grams or args.products):
        parser.error("--flops counts the steps' parts: not with --memory, --grams or --products")
    if args.memory and (args.grams or args.products):
        parser.error("--memory sizes the steps' parts: not with --grams or --products")
    if args.faults and not faults_counted():
        parser.error("--faults counts page faults with Python's `resource` module: POSIX only")
    if args.faults and (args.kernels or args.flops or args.memory or args.grams or args.products):
        parser.error(
            "--faults counts the steps' page faults: not with --kernels, --flops, --memory, "
            "--grams or --products"
        )
    if args.gpu_branches and (args.kernels or args.grams or args.products):
        parser.error(
            "--gpu-branches builds the ghost steps: not with --kernels, --grams or --products"
        )
    if args.seq is not None and not args.recurrent:
        parser.error("--seq sets a --recurrent model's sequence length: only with --recurrent")
    if args.grams and (args.mlp or args.convnet):
        parser.error("--grams times the transformer's output layer: not with --mlp or --convnet")
    if args.products and (args.grams or args.mlp or args.convnet):
        parser.error("--products times the MLP's first layer: not with --grams, --mlp or --convnet")
    if sum(map(bool, (args.mlp, args.convnet, args.recurrent, args.grams, args.products))) > 1:
        parser.error(
            "--mlp, --convnet, --recurrent, --grams and --products each choose the model: one"
        )
    pairs = args.pairs or (2 if args.quick else 3)
    if args.quick:
        shape, batches = models.TransformerShape(d=32, seq=8, vocab=64, blocks=2, heads=2), (8,)
    else:
        shape, batches = models.TransformerShape(), (128, 256)
    batches = tuple(args.batches) if args.batches else batches
    loss = functools.partial(models.transformer_loss, heads=shape.heads)
    params = models.transformer_params(shape)
    make_batch = functools.partial(models.transformer_batch, shape)
    if args.products:
        batches = tuple(args.batches) if args.batches else (256,)
    if args.mlp:
        mlp = models.MLPShape()
        loss, params = models.mlp_loss, models.mlp_params(mlp)
        make_batch = functools.partial(models.mlp_batch, mlp)
        batches = tuple(args.batches) if args.batches else (256,)
    if args.convnet:
        conv = models.ConvShape()
        loss, params = models.convnet_loss, models.convnet_params(conv)
        make_batch = functools.partial(models.convnet_batch, conv)
        batches = tuple(args.batches) if args.batches else (16, 64)
    if args.recurrent:
        import recurrent

        sizes = recurrent.Shape() if args.seq is None else recurrent.Shape(seq=args.seq)
        loss, params, make_batch = recurrent.setups(sizes)[args.recurrent]
        batches = tuple(args.batches) if args.batches else (64,)
    params = models.cast(params, args.dtype)
    make_batch = _cast_batches(make_batch, args.dtype)
    print(
        f"ghost step's parts: jax {jax.__version__}, {jax.devices()[0].platform}, {args.dtype}",
        flush=True,
    )
    rows: list[dict] = []
    for b in batches:
        if args.grams:
            new = grams(b, shape, pairs)
        elif args.products:
            mlp = models.MLPShape(inputs=16, hidden=32) if args.quick else models.MLPShape()
            new = products(b, mlp, pairs)
        elif args.kernels:
            new = kernels(loss, params, make_batch(b), args.top)
        else:
            with gpu_branches() if args.gpu_branches else contextlib.nullcontext():
                if args.flops:
                    new = flops(loss, params, make_batch(b), args.variants)
                elif args.memory:
                    new = memory(loss, params, make_batch(b), args.variants)
                elif args.faults:
                    new = faults(loss, params, make_batch(b), pairs, args.variants)
                else:
                    new = parts(loss, params, make_batch(b), pairs, args.variants)
        for row in new:
            ratio = row.get("time_ratio")
            spread = row.get("time_iqr")
            label = row.get("variant", row.get("way"))
            if "line" in row:
                text = f"batch {b:4d}  {row['line']:28s} ghost {row['ghost_s'] * 1e3:8.3f} ms"
                text += f"  non-private {row['plain_s'] * 1e3:8.3f} ms"
            elif "flops" in row:
                text = f"batch {b:4d}  {label:24s} {row['flops'] / 1e9:10.2f} GFLOP"
                ratio = row.get("flop_ratio")
            elif "faults" in row:
                text = f"batch {b:4d}  {label:24s} {row['faults']:10.0f} faults per call"
                text += f" ({row['faulted_bytes'] / 2**20:.1f} MiB), temporaries"
                text += f" {row['temp_bytes'] / 2**20:.1f} MiB"
            elif "peak_bytes" in row:
                text = f"batch {b:4d}  {label:24s} {row['peak_bytes'] / 2**20:10.3f} MiB"
                ratio = row.get("memory_ratio")
            else:
                text = f"batch {b:4d}  {label:24s} {row['time_s'] * 1e3:10.1f} ms"
            if ratio is not None:
                text += f"  x {ratio:.3f}"
            if spread is not None:
                text += f"  (IQR {spread[0]:.3f}-{spread[1]:.3f})"
            print(text, flush=True)
        rows += new
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=float))
    return rows


if __name__ == "__main__":
    main()
