"""The platform a ghost step is lowered for, decided once per step.

XLA's CPU backend and the accelerators' want different programs in a few places (whether the
Grams are taken one example at a time, how a convolution's clipped sum is laid out, whether a
bfloat16 product may return float32).
Rather than a `lax.platform_dependent` at each of those places (each one a `cond` in the
program), the part of the step after the tapped pass is traced once for each platform
(`per_platform`) and JAX lowers the branch of the platform it compiles for; every choice
inside reads the `Target` it was traced with, as plain Python. A step that makes no such
choice (a float32 model of dense layers with small Grams) is traced once.
"""

from __future__ import annotations

from jax import lax


class Target:
    """What the engine's choices depend on: whether the step runs on a CPU. It remembers
    whether it was asked (`asked`): a step whose engine never asks is the same program on
    every platform, traced once."""

    def __init__(self, cpu: bool):
        self._cpu = cpu
        self.asked = False

    @property
    def cpu(self) -> bool:
        self.asked = True
        return self._cpu


def per_platform(f):
    """``f(target)`` with the `Target` of the platform the step is lowered for: traced once
    if it never asks which platform (its result is then every platform's), else once more
    for any other platform, under one `lax.platform_dependent` for the step (the CPU's
    result, traced first, is its CPU branch's)."""
    cpu = Target(cpu=True)
    out = f(cpu)
    if not cpu.asked:
        return out
    return lax.platform_dependent(cpu=lambda: out, default=lambda: f(Target(False)))
