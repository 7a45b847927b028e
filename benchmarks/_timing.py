"""Interleaved side-by-side timers: run time in pairs, compile time of fresh functions; the
CPU a run is on.

Every figure the suite reports is a ratio of two things measured in one process, close in
time, so that the noise of a shared machine (other processes, frequency changes, page cache)
falls on both sides alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Paired:
    """Per-pair measurements of two (or more) contenders, in seconds."""

    times: tuple[tuple[float, ...], ...]  # times[k] are the samples of contender k

    @property
    def medians(self) -> tuple[float, ...]:
        return tuple(statistics.median(t) for t in self.times)

    def ratio(self, k: int = 0, ref: int = 1) -> float:
        """Median over pairs of ``time[k] / time[ref]``: the figure the suite reports."""
        return statistics.median(a / b for a, b in zip(self.times[k], self.times[ref]))

    def spread(self, k: int = 0, ref: int = 1) -> tuple[float, float]:
        """Interquartile range of the per-pair ratios: how noisy the figure is."""
        ratios = sorted(a / b for a, b in zip(self.times[k], self.times[ref]))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        return q[0], q[2]


def cpu_model(info: pathlib.Path = pathlib.Path("/proc/cpuinfo")) -> str:
    """The CPU's model where Linux names it (`info`, ``/proc/cpuinfo``), else what `platform`
    says: the machine a saved run's figures come from."""
    try:
        lines = info.read_text().splitlines() if info.exists() else []
    except OSError:
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def count(text: str) -> int:
    """An argparse type for the scripts' counts (``--pairs``, ``--batches``): a whole number
    of at least 1 (0 would mean the default, or fail deep inside a step)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def gib(text: str) -> float:
    """An argparse type for the scripts' memory limits (``--budget-gib``): a finite number of
    GiB above 0 (0 would size jax_privacy's microbatches at nothing and fail deep inside a
    step)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of GiB above 0, got {text!r}")
    return value


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def _per_call(fn: Callable[[], Any], inner: int) -> float:
    start = time.perf_counter()
    out = None
    for _ in range(inner):
        out = fn()
    _block(out)
    return (time.perf_counter() - start) / inner


def calibrate(fns: Sequence[Callable[[], Any]], min_sample_s: float) -> int:
    """Calls per sample so that the slowest contender's sample takes about ``min_sample_s``."""
    slowest = max(_per_call(fn, 1) for fn in fns)
    return max(1, min(1000, round(min_sample_s / max(slowest, 1e-9))))


def rotated_orders(n: int, rounds: int):
    """For each round, the order in which ``n`` contenders run: rotated by one each round and
    reversed every other round, so that no contender always goes first or follows the same one."""
    for r in range(rounds):
        order = [(r + i) % n for i in range(n)]
        if r % 2:
            order.reverse()
        yield order


def interleaved(
    fns: Sequence[Callable[[], Any]],
    *,
    pairs: int = 15,
    warmup: int = 2,
    min_sample_s: float = 0.02,
    each: bool = False,
) -> Paired:
    """Time zero-argument callables side by side.

    Each callable must already be compiled (the warm-up calls absorb anything left). For each
    of ``pairs`` rounds every contender runs once (``inner`` calls, timed to the last
    ``block_until_ready``), and the order rotates from round to round so no side always goes
    first. ``inner`` is the same for all, set by the slowest; with ``each``, every contender
    gets its own, so that a step of milliseconds beside one of seconds is still timed over
    ``min_sample_s``. Returns the per-call times of every round.
    """
    for fn in fns:
        for _ in range(warmup):
            _block(fn())
    if each:
        inner = [calibrate([fn], min_sample_s) for fn in fns]
    else:
        inner = [calibrate(fns, min_sample_s)] * len(fns)
    samples: list[list[float]] = [[] for _ in fns]
    for order in rotated_orders(len(fns), pairs):
        for k in order:
            samples[k].append(_per_call(fns[k], inner[k]))
    return Paired(tuple(tuple(s) for s in samples))


def compile_time(make_fn: Callable[[], Callable[..., Any]], args: Sequence[Any]) -> float:
    """Seconds to trace, lower and compile a fresh function on ``args``.

    ``make_fn`` must return a new Python function object on every call, so that neither
    jax's tracing caches nor its in-memory executable cache can answer from an earlier
    compilation; ``jax.clear_caches()`` runs first for the same reason (it also drops what
    earlier benchmarks compiled, so time run time before compile time). The persistent
    compilation cache is off unless configured.
    """
    jax.clear_caches()  # inner jitted helpers would otherwise answer from their trace cache
    fn = make_fn()
    start = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start


def interleaved_compile(
    makers: Sequence[Callable[[], Callable[..., Any]]],
    args: Sequence[Sequence[Any]],
    *,
    pairs: int = 3,
) -> Paired:
    """Compile times of several function makers (maker k on ``args[k]``), interleaved and
    rotated like ``interleaved``."""
    samples: list[list[float]] = [[] for _ in makers]
    for order in rotated_orders(len(makers), pairs):
        for k in order:
            samples[k].append(compile_time(makers[k], args[k]))
    return Paired(tuple(tuple(s) for s in samples))
