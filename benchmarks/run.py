"""optclip against optax's clipping, side by side, in one process.

    python benchmarks/run.py                 # the full suite (a few minutes on 2 CPU cores)
    python benchmarks/run.py --quick         # tiny shapes, few repetitions: a smoke test
    python benchmarks/run.py --only step,norm --json results.json
    python benchmarks/run.py --impl optax    # optax on both sides: checks the harness

Every figure is a ratio of two contenders timed in the same process: interleaved rounds
(the order rotates each round), the median over rounds of the per-round ratio, after
compilation and warm-up. Compile times are of fresh function objects after
``jax.clear_caches()``. Sections (``--only``): step, overhead, norm, many_leaves, bf16,
per_example, groups, adaptive, loss_scaling (needs jmp: ``pip install -e ".[bench]"``), memory,
accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _impls  # noqa: E402
import _loss_scaling  # noqa: E402
import _timing  # noqa: E402
import _trees  # noqa: E402

SECTIONS = (
    "step",
    "overhead",
    "norm",
    "many_leaves",
    "bf16",
    "per_example",
    "groups",
    "adaptive",
    "loss_scaling",
    "memory",
    "accuracy",
)


@dataclasses.dataclass(frozen=True)
class Config:
    quick: bool
    shape: _trees.TransformerShape
    pairs: int
    compile_pairs: int
    norm_leaves: tuple[int, int]  # many-leaves norm: (leaves, floats per leaf)
    chain_leaves: tuple[int, int]  # many-leaves chain compile: (leaves, floats per leaf)
    accuracy_leaves: tuple[int, ...]
    accuracy_seeds: int
    min_sample_s: float
    per_example: tuple[int, int]  # per-example clipping: (examples, width of the dense layer)
    per_example_mlp: tuple[int, ...]  # per-example clipping: widths of a dense network
    stacked: _trees.TransformerShape  # per-layer norms: a scanned transformer

    @classmethod
    def make(cls, quick: bool, pairs: int | None, compile_pairs: int | None) -> Config:
        if quick:
            return cls(
                quick=True,
                shape=_trees.TransformerShape.quick(),
                pairs=pairs or 5,
                compile_pairs=compile_pairs or 1,
                norm_leaves=(200, 100),
                chain_leaves=(100, 16),
                accuracy_leaves=(10, 100, 1000),
                accuracy_seeds=1,
                min_sample_s=0.005,
                per_example=(8, 32),
                per_example_mlp=(64, 32, 32, 10),
                stacked=_trees.TransformerShape(vocab=1000, d_model=32, n_blocks=4),
            )
        return cls(
            quick=False,
            shape=_trees.TransformerShape(),
            pairs=pairs or 15,
            compile_pairs=compile_pairs or 3,
            norm_leaves=(2000, 1000),
            chain_leaves=(1000, 64),
            accuracy_leaves=(10, 100, 1000),
            accuracy_seeds=3,
            min_sample_s=0.05,
            per_example=(64, 256),
            per_example_mlp=(784, 256, 256, 10),
            stacked=_trees.TransformerShape(vocab=8000, d_model=128, n_blocks=24),
        )


@dataclasses.dataclass
class Row:
    section: str
    name: str
    ours: float | None
    ref: float | None
    unit: str  # "s", "B", "rel" or "n" (a count)
    ratio: float | None
    target: str  # human-readable, e.g. "<= 1.00"
    passed: bool | None  # None: reported for context, no target
    ref_name: str = "optax"
    spread: tuple[float, float] | None = None  # interquartile range of per-pair ratios
    note: str = ""


def _ratio_row(section, name, paired, k, ref, limit, ref_name="optax", note="", target=None):
    ratio = paired.ratio(k, ref)
    med = paired.medians
    return Row(
        section=section,
        name=name,
        ours=med[k],
        ref=med[ref],
        unit="s",
        ratio=ratio,
        target=target or (f"<= {limit:.2f}" if limit is not None else ""),
        passed=None if limit is None else ratio <= limit,
        ref_name=ref_name,
        spread=paired.spread(k, ref),
        note=note,
    )


class Suite:
    def __init__(self, cfg: Config, side: _impls.Side):
        self.cfg = cfg
        self.side = side
        self.rows: list[Row] = []
        self._cache: dict[Any, Any] = {}

    def log(self, msg: str) -> None:
        print(f"  [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ shared pieces

    def transformer(self, dtype) -> Any:
        key = ("tree", jnp.dtype(dtype).name)
        if key not in self._cache:
            shapes = _trees.transformer_shapes(self.cfg.shape)
            self._cache[key] = _trees.random_tree(shapes, dtype)
        return self._cache[key]

    def optimizers(self) -> dict[str, optax.GradientTransformation]:
        return {
            "ours": optax.chain(self.side.global_clip(1.0), optax.adam(1e-3)),
            "optax": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            "adam": optax.adam(1e-3),
        }

    def steps(self, dtype) -> tuple[dict[str, Any], Any]:
        """Jitted ``update`` of each optimizer, state donated, with a fresh state; and the
        gradient tree. The jitted functions are made once per dtype (compiled once)."""
        grads = self.transformer(dtype)
        key = ("step_fns", jnp.dtype(dtype).name)
        if key not in self._cache:
            self._cache[key] = {
                name: (jax.jit(opt.update, donate_argnums=(1,)), opt)
                for name, opt in self.optimizers().items()
            }
        out = {name: (fn, opt.init(grads)) for name, (fn, opt) in self._cache[key].items()}
        return out, grads

    def step_timing(self, dtype) -> _timing.Paired:
        """One three-way interleaved measurement: [ours chain, optax chain, bare adam]."""
        key = ("step", jnp.dtype(dtype).name)
        if key in self._cache:
            return self._cache[key]
        steps, grads = self.steps(dtype)
        self.log(
            f"step timing ({jnp.dtype(dtype).name}, {_trees.n_params(grads):,} params, "
            f"{len(jax.tree.leaves(grads))} leaves)"
        )
        runners = []
        for name in ("ours", "optax", "adam"):
            fn, state = steps[name]
            box = [state]

            def run(fn=fn, box=box):
                updates, box[0] = fn(grads, box[0])
                return updates

            runners.append(run)
        paired = _timing.interleaved(
            runners, pairs=self.cfg.pairs, min_sample_s=self.cfg.min_sample_s
        )
        self._cache[key] = paired
        return paired

    # ------------------------------------------------------------------ sections

    def step(self) -> None:
        p = self.step_timing(jnp.float32)
        self.rows.append(_ratio_row("step", "clip+adam step, float32", p, 0, 1, 1.00))

    def overhead(self) -> None:
        p = self.step_timing(jnp.float32)
        floor = 7 / 6  # adam moves 6 arrays (reads g, mu, nu; writes u, mu, nu); +1 read of g
        row = _ratio_row(
            "overhead",
            "clip+adam over bare adam",
            p,
            0,
            2,
            1.20,
            ref_name="adam",
            target=f"<= 1.20 (floor {floor:.2f})",
        )
        ref = p.ratio(1, 2)
        row.note = f"optax's chain: {ref:.2f}x adam"
        self.rows.append(row)

    def bf16(self) -> None:
        p = self.step_timing(jnp.bfloat16)
        row = _ratio_row("bf16", "clip+adam step, bfloat16", p, 0, 1, 1.00)
        row.note = f"over bare adam: ours {p.ratio(0, 2):.2f}x, optax {p.ratio(1, 2):.2f}x"
        self.rows.append(row)

    def norm(self) -> None:
        grads = self.transformer(jnp.float32)
        flat = jnp.concatenate([x.ravel() for x in jax.tree.leaves(grads)])
        flat.block_until_ready()
        ours = jax.jit(self.side.global_norm)
        floor = jax.jit(lambda x: jnp.sqrt(jnp.sum(jnp.square(x))))
        ref = jax.jit(optax.tree.norm)
        self.log(f"norm timing ({flat.size:,} floats)")
        p = _timing.interleaved(
            [lambda: ours(grads), lambda: floor(flat), lambda: ref(grads)],
            pairs=self.cfg.pairs,
            min_sample_s=self.cfg.min_sample_s,
        )
        row = _ratio_row(
            "norm", "global_norm vs flat sum of squares", p, 0, 1, 1.10, ref_name="flat array"
        )
        row.note = f"optax.tree.norm: {p.ratio(2, 1):.2f}x the floor"
        self.rows.append(row)

    def many_leaves(self) -> None:
        cfg = self.cfg
        n, size = cfg.norm_leaves
        tree = _trees.many_leaves(n, size)
        ours = jax.jit(self.side.global_norm)
        ref = jax.jit(optax.tree.norm)
        self.log(f"many leaves: norm run time ({n} x {size})")
        p = _timing.interleaved(
            [lambda: ours(tree), lambda: ref(tree)], pairs=cfg.pairs, min_sample_s=cfg.min_sample_s
        )
        self.rows.append(_ratio_row("many_leaves", f"norm run, {n} leaves x {size}", p, 0, 1, 0.50))

        # Chain run time, 1000 x 64, before any compile timing clears the caches.
        n2, size2 = cfg.chain_leaves
        small = _trees.many_leaves(n2, size2, seed=1)
        opts = self.optimizers()
        runners = []
        for name in ("ours", "optax"):
            fn = jax.jit(opts[name].update)
            state = opts[name].init(small)
            runners.append(lambda fn=fn, state=state: fn(small, state))
        self.log(f"many leaves: chain run time ({n2} x {size2})")
        p = _timing.interleaved(runners, pairs=cfg.pairs, min_sample_s=cfg.min_sample_s)
        self.rows.append(
            _ratio_row("many_leaves", f"clip+adam run, {n2} leaves x {size2}", p, 0, 1, 1.00)
        )

        self.log(f"many leaves: norm compile time ({n} x {size}, {cfg.compile_pairs} pairs)")
        side = self.side
        pc = _timing.interleaved_compile(
            [lambda: lambda t: side.global_norm(t), lambda: lambda t: optax.tree.norm(t)],
            [(tree,), (tree,)],
            pairs=cfg.compile_pairs,
        )
        self.rows.append(
            _ratio_row(
                "many_leaves",
                f"norm compile, {n} leaves x {size}",
                pc,
                0,
                1,
                0.10,
                note=f"{cfg.compile_pairs} pairs",
            )
        )

        self.log(f"many leaves: chain compile time ({n2} x {size2}, {cfg.compile_pairs} rounds)")

        def maker(make_opt: Callable[[], optax.GradientTransformation]):
            def make():
                opt = make_opt()
                return lambda g, s: opt.update(g, s)

            return make

        makers = [
            maker(lambda: optax.chain(side.global_clip(1.0), optax.adam(1e-3))),
            maker(lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))),
            maker(lambda: optax.adam(1e-3)),
        ]
        args = [(small, opts[name].init(small)) for name in ("ours", "optax", "adam")]
        samples = _timing.interleaved_compile(makers, args, pairs=cfg.compile_pairs).times
        ours_add = [a - c for a, c in zip(samples[0], samples[2])]
        ref_add = [b - c for b, c in zip(samples[1], samples[2])]
        ours_m, ref_m = statistics.median(ours_add), statistics.median(ref_add)
        ratio = ours_m / ref_m if ref_m > 0 else math.inf
        self.rows.append(
            Row(
                section="many_leaves",
                name=f"added compile of clip+adam over adam, {n2} x {size2}",
                ours=ours_m,
                ref=ref_m,
                unit="s",
                ratio=ratio,
                target="<= 0.50",
                passed=ratio <= 0.50,
                note=f"adam alone {statistics.median(samples[2]):.2f}s; {cfg.compile_pairs} rounds",
            )
        )

    def per_example(self) -> None:
        """Per-example clipping (DP-SGD): `vmap` of the clip transform, then the library's
        per-example functions (clip every example, sum over the batch) against optax's."""
        cfg = self.cfg
        n, width = cfg.per_example
        shapes = {"w": (n, width, width), "b": (n, width)}
        grads = _trees.numpy_tree(shapes, jnp.float32, seed=2)

        def per_example_clip(tx):
            def clip(g):
                updates, _ = tx.update(g, tx.init(g))
                return updates

            return jax.jit(jax.vmap(clip))

        ours = per_example_clip(self.side.global_clip(1.0))
        ref = per_example_clip(optax.clip_by_global_norm(1.0))
        self.log(f"per-example clipping ({n} examples x ({width}x{width} + {width}))")
        p = _timing.interleaved(
            [lambda: ours(grads), lambda: ref(grads)],
            pairs=cfg.pairs,
            min_sample_s=cfg.min_sample_s,
        )
        self.rows.append(
            _ratio_row(
                "per_example",
                f"vmap of global clip, {n} examples",
                p,
                0,
                1,
                None,
                note="no target: per-example clipping must not run the overflow fallback",
            )
        )

        # The per-example functions on two trees: the dense layer above and a small MLP.
        widths = "-".join(str(w) for w in cfg.per_example_mlp)
        trees = {
            f"{width}x{width}+{width}": [(width, width), (width,)],
            f"MLP {widths}": _trees.mlp_shapes(cfg.per_example_mlp),
        }
        if cfg.quick:  # one tree: every row kind still runs, in a few seconds
            trees = dict(list(trees.items())[1:])
        side = self.side
        contenders = [  # (ours, optax's): what each row compares
            ("per_example_clip", side.per_example_clip, optax.per_example_global_norm_clip),
            (
                "per_example_layer_clip",
                side.per_example_layer_clip,
                optax.per_example_layer_norm_clip,
            ),
        ]
        batches = {
            name: _trees.numpy_tree(_trees.per_example(shapes, n), jnp.float32, seed=3)
            for name, shapes in trees.items()
        }
        # Jitted as inside a DP-SGD step: the sum feeds the optimizer (noise, update), so it is
        # the output; the counts are dropped by XLA on both sides.
        for name, batch in batches.items():
            self.log(f"per-example functions, run time ({n} examples, {name})")
            fns = [jax.jit(lambda g, f=f: f(g, 1.0)[0]) for _, a, b in contenders for f in (a, b)]
            p = _timing.interleaved(
                [lambda f=f, batch=batch: f(batch) for f in fns],
                pairs=cfg.pairs,
                min_sample_s=cfg.min_sample_s,
            )
            for k, (label, _, _) in enumerate(contenders):
                row_name = f"{label} run, {n} x {name}"
                self.rows.append(_ratio_row("per_example", row_name, p, 2 * k, 2 * k + 1, 1.00))
            # Context, timed apart (it is ~20x slower, and timed among the others it sets how
            # many calls every sample makes): what users wrote before, vmap of the global
            # clip then a sum, against the library's per-example clip and optax's.
            vmap_sum = jax.jit(lambda g: jax.tree.map(lambda x: x.sum(0), ours(g)))
            pv = _timing.interleaved(
                [lambda f=f, batch=batch: f(batch) for f in (vmap_sum, fns[0], fns[1])],
                pairs=cfg.pairs,
                min_sample_s=cfg.min_sample_s,
            )
            row = _ratio_row(
                "per_example", f"vmap(global clip) + sum run, {n} x {name}", pv, 0, 1, None
            )
            row.ref_name = f"{side.name} per_example_clip"
            row.note = f"{pv.ratio(0, 2):.2f}x optax.per_example_global_norm_clip"
            self.rows.append(row)

        # Compile times last: they clear JAX's caches.
        for name, batch in batches.items():
            self.log(f"per-example functions, compile time ({n} examples, {name})")

            def maker(f):
                return lambda: lambda g: f(g, 1.0)[0]

            makers = [maker(f) for _, a, b in contenders for f in (a, b)]
            pc = _timing.interleaved_compile(
                makers, [(batch,)] * len(makers), pairs=cfg.compile_pairs
            )
            for k, (label, _, _) in enumerate(contenders):
                self.rows.append(
                    _ratio_row(
                        "per_example",
                        f"{label} compile, {n} x {name}",
                        pc,
                        2 * k,
                        2 * k + 1,
                        None,
                        note=f"{cfg.compile_pairs} pairs",
                    )
                )

    def groups(self) -> None:
        """Per-leaf norms (`group_norms="leaf"`) in the state: the step with them against the
        same step without them, on a 1000-leaf model; and per-layer norms of a scanned model's
        stacked blocks against the plain step (the norms come from the same partial sums, so
        the target is parity)."""
        if self.side.name != "optclip":
            self.log("groups: skipped (only optclip keeps group norms)")
            return
        import optclip

        n, size = self.cfg.chain_leaves
        tree = _trees.many_leaves(n, size, seed=3)
        runners = []
        for spec in ("leaf", None):
            opt = optax.chain(optclip.global_clip(1.0, group_norms=spec), optax.adam(1e-3))
            fn = jax.jit(opt.update, donate_argnums=(1,))
            box = [opt.init(tree)]

            def run(fn=fn, box=box):
                updates, box[0] = fn(tree, box[0])
                return updates

            runners.append(run)
        self.log(f"groups: clip+adam step with and without a norm per leaf ({n} x {size})")
        p = _timing.interleaved(runners, pairs=self.cfg.pairs, min_sample_s=self.cfg.min_sample_s)
        self.rows.append(
            _ratio_row(
                "groups",
                f"clip+adam step, a norm per leaf vs none, {n} leaves x {size}",
                p,
                0,
                1,
                1.02,
                ref_name="no groups",
            )
        )
        self._stacked_groups()

    def _stacked_groups(self) -> None:
        import optclip

        shape = self.cfg.stacked
        tree = _trees.numpy_tree(_trees.stacked_transformer_shapes(shape), seed=4, scale=1e-3)
        specs = {
            "none": {},
            "layer": {"stacked": "blocks", "group_norms": "layer"},
            "leaf": {"stacked": "blocks", "group_norms": "leaf"},
        }
        runners = []
        for kwargs in specs.values():
            opt = optax.chain(optclip.global_clip(1.0, **kwargs), optax.adam(1e-3))
            fn = jax.jit(opt.update, donate_argnums=(1,))
            box = [opt.init(tree)]

            def run(fn=fn, box=box):
                updates, box[0] = fn(tree, box[0])
                return updates

            runners.append(run)
        n, size = shape.n_blocks, _trees.n_params(tree)
        self.log(f"groups: clip+adam step, {n} stacked blocks, per-layer norms vs none")
        p = _timing.interleaved(runners, pairs=self.cfg.pairs, min_sample_s=self.cfg.min_sample_s)
        for k, what in enumerate(["a norm per layer", "a norm per layer and leaf"], start=1):
            self.rows.append(
                _ratio_row(
                    "groups",
                    f"clip+adam step, {what} vs none, {n} stacked blocks ({size / 1e6:.1f}M)",
                    p,
                    k,
                    0,
                    1.02,
                    ref_name="no groups, no stacked",
                )
            )

    def adaptive(self) -> None:
        """AdaGC (a threshold per leaf, from its own EMA) in a clip+adam step, against the
        global clip users have today: there is no JAX AdaGC. The transformer tree, float32;
        AdaGC past its warm-up (both phases run the same program)."""
        if self.side.name != "optclip":
            self.log("adaptive: skipped (only optclip has AdaGC)")
            return
        import optclip

        steps, grads = self.steps(jnp.float32)  # the global clips' steps (compiled for `step`)
        adagc = optax.chain(optclip.adagc(warmup_steps=1), optax.adam(1e-3))
        contenders = [
            (jax.jit(adagc.update, donate_argnums=(1,)), adagc.init(grads)),
            steps["ours"],
            steps["optax"],
        ]
        runners = []
        for fn, state in contenders:
            box = [state]

            def run(fn=fn, box=box):
                updates, box[0] = fn(grads, box[0])
                return updates

            runners.append(run)
        leaves = len(jax.tree.leaves(grads))
        self.log(f"adaptive: adagc+adam vs global clip+adam ({leaves} leaves)")
        p = _timing.interleaved(runners, pairs=self.cfg.pairs, min_sample_s=self.cfg.min_sample_s)
        row = _ratio_row(
            "adaptive",
            f"adagc+adam step vs optax clip_by_global_norm+adam, {leaves} leaves",
            p,
            0,
            2,
            1.10,
        )
        row.note = f"vs optclip.global_clip+adam: {p.ratio(0, 1):.2f}x"
        self.rows.append(row)

    def loss_scaling(self) -> None:
        """The step with dynamic loss scaling folded into the clip (and with the spike test
        too) against the same guarded step without the scale (the fold's cost: parity), the
        same clip with no guard at all, and jmp + optax; the passes over the largest gradient in
        each compiled step."""
        if self.side.name != "optclip":
            self.log("loss_scaling: skipped (only optclip folds the loss scale into the clip)")
            return
        grads = self.transformer(jnp.float32)
        p, passes, names = _loss_scaling.measure(
            grads, self.cfg.pairs, self.cfg.min_sample_s, self.log
        )
        k = {name: i for i, name in enumerate(names)}
        scaled, spikes = k["optclip, loss scaling"], k["optclip, loss scaling + spikes"]
        skip_only, alone, jmp = (
            k["optclip, skipped steps only"],
            k["optclip, clip alone"],
            k["jmp + optax"],
        )
        rows = [
            (
                "loss scaling, vs the same guarded step without it",
                scaled,
                skip_only,
                1.02,
                "guarded, no scale",
            ),
            (
                "loss scaling + spike test, vs loss scaling alone",
                spikes,
                scaled,
                1.02,
                "loss scaling",
            ),
            (
                "loss scaling, vs the clip with no guard (no skip)",
                scaled,
                alone,
                1.02,
                "clip alone",
            ),
            ("loss scaling, vs jmp + optax", scaled, jmp, 1.00, "jmp + optax"),
        ]
        for label, a, b, limit, ref_name in rows:
            row = _ratio_row(
                "loss_scaling", f"clip+adam step: {label}", p, a, b, limit, ref_name=ref_name
            )
            self.rows.append(row)
        self.rows[-2].note = f"the guard's skip alone: {p.ratio(skip_only, alone):.2f}x"
        window, multi = k["optclip, accumulation window"], k["jmp + optax.MultiSteps window"]
        label = f"a window of {_loss_scaling.WINDOW} micro-batches with loss scaling"
        self.rows.append(
            _ratio_row(
                "loss_scaling",
                f"{label}: guarded(accumulation_steps=...), vs jmp + optax.MultiSteps",
                p,
                window,
                multi,
                1.00,
                ref_name="jmp + MultiSteps",
            )
        )
        self.rows[-1].note = f"vs one loss-scaled step: {p.ratio(window, scaled):.2f}x"
        self.rows.append(
            Row(
                section="loss_scaling",
                name="passes over the largest gradient, step with loss scaling",
                ours=passes[names[scaled]],
                ref=passes[names[jmp]],
                unit="n",
                ratio=passes[names[scaled]] / passes[names[jmp]],
                target=f"<= clip alone ({passes[names[alone]]})",
                passed=passes[names[scaled]] <= passes[names[alone]],
                ref_name="jmp + optax",
                note="kernels reading gradient-sized data, adam's own included",
            )
        )

    def memory(self) -> None:
        for dtype in (jnp.float32, jnp.bfloat16):
            self.log(f"memory analysis of the jitted step ({jnp.dtype(dtype).name})")
            grads = self.transformer(dtype)
            opts = self.optimizers()
            peaks, temps = {}, {}
            for name, opt in opts.items():
                state = opt.init(grads)
                fn = jax.jit(opt.update, donate_argnums=(1,))
                mem = fn.lower(grads, state).compile().memory_analysis()
                peaks[name] = (
                    mem.argument_size_in_bytes
                    + mem.output_size_in_bytes
                    - mem.alias_size_in_bytes
                    + mem.temp_size_in_bytes
                )
                temps[name] = mem.temp_size_in_bytes
            dname = jnp.dtype(dtype).name
            self.rows.append(
                Row(
                    section="memory",
                    name=f"peak of jitted step, {dname}",
                    ours=peaks["ours"],
                    ref=peaks["optax"],
                    unit="B",
                    ratio=peaks["ours"] / peaks["optax"],
                    target="<= 1.00",
                    passed=peaks["ours"] <= peaks["optax"],
                    note=(
                        f"args+out-alias+temp; temp ours {_fmt_bytes(temps['ours'])}, optax "
                        f"{_fmt_bytes(temps['optax'])}; bare adam peak "
                        f"{_fmt_bytes(peaks['adam'])}"
                    ),
                )
            )

    def accuracy(self) -> None:
        cfg = self.cfg
        ours = jax.jit(self.side.global_norm)
        ref = optax.tree.norm if cfg.quick else jax.jit(optax.tree.norm)
        for dtype in (jnp.bfloat16, jnp.float16):
            for n in cfg.accuracy_leaves:
                self.log(f"accuracy: {jnp.dtype(dtype).name}, {n} leaves")
                err_ours, err_ref = 0.0, 0.0
                for seed in range(cfg.accuracy_seeds):
                    tree = _trees.accuracy_tree(n, dtype, seed=seed)
                    exact = _trees.float64_norm(tree)
                    err_ours = max(err_ours, abs(float(ours(tree)) - exact) / exact)
                    err_ref = max(err_ref, abs(float(ref(tree)) - exact) / exact)
                self.rows.append(
                    Row(
                        section="accuracy",
                        name=f"norm rel. error, {jnp.dtype(dtype).name}, {n} leaves",
                        ours=err_ours,
                        ref=err_ref,
                        unit="rel",
                        ratio=None,
                        target="ours <= 1e-06",
                        passed=err_ours <= 1e-6,
                        note=f"max over {cfg.accuracy_seeds} seeds"
                        + ("; optax eager" if cfg.quick else ""),
                    )
                )


# ---------------------------------------------------------------------- output


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
    if unit == "B":
        return _fmt_bytes(value)
    if unit == "n":
        return f"{value:.0f}"
    return f"{value:.2e}"


def format_table(rows: list[Row], side_name: str) -> str:
    header = ["benchmark", side_name, "reference", "ratio", "IQR", "target", "result", "note"]
    body = []
    for r in rows:
        result = {True: "PASS", False: "MISS", None: "info"}[r.passed]
        body.append(
            [
                r.name,
                _fmt(r.ours, r.unit),
                f"{_fmt(r.ref, r.unit)} ({r.ref_name})",
                "-" if r.ratio is None else f"{r.ratio:.3f}",
                "-" if r.spread is None else f"{r.spread[0]:.2f}-{r.spread[1]:.2f}",
                r.target,
                result,
                r.note,
            ]
        )
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]
    lines = [
        " | ".join(h.ljust(w) for h, w in zip(header, widths)),
        "-|-".join("-" * w for w in widths),
    ]
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in body]
    return "\n".join(line.rstrip() for line in lines)


def machine() -> dict[str, Any]:
    return {
        "cpu": _timing.cpu_model(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "numpy": np.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--json", default=None, help="write the results to this path")
    parser.add_argument("--pairs", type=_timing.count, default=None, help="timed rounds per figure")
    parser.add_argument(
        "--compile-pairs", type=_timing.count, default=None, help="rounds of compile timing"
    )
    parser.add_argument(
        "--impl",
        default="optclip",
        choices=("optclip", "optax"),
        help="library under test; 'optax' checks the harness (ratios ~1)",
    )
    args = parser.parse_args(argv)

    only = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTIONS)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")

    cfg = Config.make(args.quick, args.pairs, args.compile_pairs)
    side = _impls.resolve(args.impl)
    info = machine()
    command = "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]])
    print(
        f"optclip benchmarks: {side.name} vs optax {optax.__version__}, jax {jax.__version__}"
        f", {info['nproc']} x {info['cpu']}; mode {'quick' if cfg.quick else 'full'}, "
        f"{cfg.pairs} pairs",
        flush=True,
    )

    suite = Suite(cfg, side)
    start = time.perf_counter()
    for name in SECTIONS:
        if name in only:
            getattr(suite, name)()
    elapsed = time.perf_counter() - start

    print(format_table(suite.rows, side.name))
    misses = [r.name for r in suite.rows if r.passed is False]
    print(
        f"\n{sum(r.passed is True for r in suite.rows)} targets met, {len(misses)} missed"
        f" ({elapsed:.0f} s)."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": command,
                    "machine": info,
                    "impl": side.name,
                    "config": dataclasses.asdict(cfg),
                    "elapsed_s": elapsed,
                    "rows": [dataclasses.asdict(r) for r in suite.rows],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
