"""Passes over the gradients in a compiled program, counted on its optimized HLO.

A *pass* is one kernel of the program's entry computation (a fusion, or an unfused operation)
that reads gradient-sized data computed from the gradients: the gradients themselves or an
intermediate array made from them (an unscaled copy, the optimizer's new moments). The common
path is counted: a `conditional` (the norm's rare overflow fallback) is not a pass, but an array
written out only so that it can be handed to one is (its writer reads the gradients).

This is how the benchmark and the tests compare the step with loss scaling against the same
step without it, and against jmp + optax, without timing anything.
"""

from __future__ import annotations

import math
import re

import jax

_NOT_KERNELS = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "conditional"}
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"^[a-z]\w*\[([\d,]*)\]")


def _elements(shape: str) -> int:
    match = _ARRAY.match(shape)
    if not match:
        return 0  # a tuple or a token
    dims = [int(d) for d in match.group(1).split(",") if d]
    return math.prod(dims)


def _split(rhs: str) -> tuple[str, str, str]:
    """``(shape, opcode, operand text)`` of an instruction's right-hand side."""
    depth, i = 0, 0
    while i < len(rhs):  # the shape may be a tuple: skip to its end
        depth += rhs[i] == "("
        depth -= rhs[i] == ")"
        if rhs[i] == " " and depth == 0:
            break
        i += 1
    shape, rest = rhs[:i], rhs[i:].strip()
    opcode = rest.split("(", 1)[0]
    depth, start = 0, len(opcode)
    for j in range(start, len(rest)):
        depth += rest[j] == "("
        depth -= rest[j] == ")"
        if depth == 0:
            return shape, opcode, rest[start + 1 : j]
    return shape, opcode, rest[start + 1 :]


def entry_instructions(hlo_text: str) -> list[tuple[str, str, str, str]]:
    """``(name, shape, opcode, operand text)`` of every instruction of the entry computation."""
    lines = hlo_text[hlo_text.index("\nENTRY") :].splitlines()[1:]
    out = []
    for line in lines:
        if line.startswith("}"):
            break
        match = _DEFINITION.match(line)
        if not match:
            continue
        shape, opcode, operands = _split(match.group(2))
        out.append((match.group(1), shape, opcode, operands))
    return out


def count_passes(hlo_text: str, gradient_parameters: set[int], min_elements: int) -> int:
    """Kernels of the entry computation reading an array of at least `min_elements` elements
    computed from the entry parameters numbered `gradient_parameters`."""
    derived: dict[str, bool] = {}
    sizes: dict[str, int] = {}
    passes = 0
    for name, shape, opcode, text in entry_instructions(hlo_text):
        sizes[name] = _elements(shape)
        if opcode == "parameter":
            derived[name] = int(text) in gradient_parameters
            continue
        operands = re.findall(r"%[\w.\-]+", text)
        from_gradients = [o for o in operands if derived.get(o)]
        derived[name] = bool(from_gradients)
        big = [o for o in from_gradients if sizes.get(o, 0) >= min_elements]
        if big and opcode not in _NOT_KERNELS:
            passes += 1
    return passes


def passes_of(fn, args, gradient_argnum: int = 0) -> int:
    """Passes over the gradients (argument `gradient_argnum`, a pytree) of ``jax.jit(fn)``
    compiled for `args`; gradient-sized means at least half the largest gradient leaf (on a
    model's gradients: the passes over its largest leaves, such as the embedding's)."""
    before = len(jax.tree.leaves(args[:gradient_argnum]))
    leaves = jax.tree.leaves(args[gradient_argnum])
    numbers = set(range(before, before + len(leaves)))
    text = jax.jit(fn).lower(*args).compile().as_text()
    return count_passes(text, numbers, max(x.size for x in leaves) // 2)
