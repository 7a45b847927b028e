"""An eager call of `clipped_grad` run as one compiled program.

Called outside any transformation, the engine's operations would run one at a time, each
compiled on its own the first time it meets its shapes, several times slower than the same
step under `jax.jit` (the design notes have the measurements). So an eager call traces the
per-example loss now (as the engine would), and runs the engine on that trace under one
`jax.jit`, kept by the `clipped_grad` function for the next call that traces the same.

What the compiled program depends on is its key: the loss's jaxpr as text (its operations,
the numbers written in it, the shapes), the shapes and dtypes of what it is traced with, the
arguments' tree, the Python values among the arguments (a number that reaches only a custom
derivative rule, as a gradient reversal layer's coefficient does, is not in the jaxpr's
text), and the values of the scalar constants the loss holds (the ghost analysis reads them:
`_views.held`). Everything else is passed to the program at every call: the arguments'
arrays and the arrays the loss closes over, so that a loss sees the current value of a
global array at each call, as it would eagerly, where a cached `jax.jit` of the whole call
would keep the first one. The Python code the loss hands to JAX (a custom derivative rule, a
callback: shown in the jaxpr by name only) is the compiling call's, as under `jax.jit`.
"""

from __future__ import annotations

import collections

import jax

from optclip import _checks
from optclip.per_example.ghost import _batch, _views

# Programs a `clipped_grad` function keeps (the least recently used is dropped).
LIMIT = 8


def is_eager(tree) -> bool:
    """Whether no leaf of `tree` (a call's arguments) is traced: the call is outside any
    transformation of its arguments."""
    return not any(_checks.is_traced(x) for x in jax.tree.leaves(tree))


def value_key(value):
    """A Python value among the arguments as the key holds it: its type and, for a number,
    its `repr` (which tells -0.0 from 0.0, and is equal for NaN; ``1 == 1.0 == True``)."""
    return type(value), repr(value) if isinstance(value, (float, complex)) else value


class Programs:
    """``finish(one, args, kwargs, padding, s)`` (the rest of a `clipped_grad` call, from the
    per-example loss `one`), run eagerly as one compiled program per key."""

    def __init__(self, finish):
        self.finish = finish
        self.kept: collections.OrderedDict = collections.OrderedDict()

    def __call__(self, one, args, kwargs, padding, s: _batch.Settings):
        flat = _batch.flatten(args, kwargs, s)
        single = _batch.one_example(flat)
        closed, out_shape = jax.make_jaxpr(_batch.flat_loss(one, flat), return_shape=True)(*single)
        if not is_eager(closed.consts):  # (it closes over a value traced by a caller)
            return self.finish(one, args, kwargs, padding, s)
        constvars = closed.jaxpr.constvars
        numbers = _views.held(constvars, closed.consts)
        baked = {i: closed.consts[i] for i, var in enumerate(constvars) if var in numbers}
        tree = jax.tree.structure((args, kwargs))
        statics = [x for x, st in zip(jax.tree.leaves((args, kwargs)), flat.static) if st]
        key = (
            str(closed.jaxpr),
            tuple(closed.in_avals),
            tuple(flat.static),
            tuple(map(value_key, statics)),
            tree,
            tuple(
                (i, str(numbers[constvars[i]].dtype), numbers[constvars[i]].tobytes())
                for i in baked
            ),
        )
        try:
            program = self.kept.pop(key, None)
        except TypeError:  # (an argument's tree, or a Python value, that cannot be hashed)
            return self.finish(one, args, kwargs, padding, s)
        if program is None:
            program = self._compile(closed.jaxpr, baked, out_shape, tree, flat.static, statics, s)
        self.kept[key] = program
        while len(self.kept) > LIMIT:
            self.kept.popitem(last=False)
        arrays = [c for i, c in enumerate(closed.consts) if i not in baked]
        return program(arrays, flat.leaves, padding)

    def _compile(self, jaxpr, baked: dict, out_shape, tree, static: list, statics: list, s):
        """The program for one key. It holds no array of the call that made it (the loss's
        jaxpr, its scalar constants, the arguments' Python values): a kept program keeps no
        batch, parameters or table alive."""
        out_tree = jax.tree.structure(out_shape)
        count = len(jaxpr.constvars)

        def program(arrays, leaves, padding):
            rest = iter(arrays)
            consts = [baked[i] if i in baked else next(rest) for i in range(count)]

            def one(args, kwargs):  # (the loss as traced, on this call's values)
                flat = jax.tree.leaves((args, kwargs))
                xs = [x for x, st in zip(flat, static, strict=True) if not st]
                return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(jaxpr, consts, *xs))

            values, held = iter(leaves), iter(statics)
            full = [next(held) if st else next(values) for st in static]
            return self.finish(one, *jax.tree.unflatten(tree, full), padding, s)

        return jax.jit(program)
