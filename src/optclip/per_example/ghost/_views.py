"""Views of a parameter leaf: the leaf after the operations that leave its gradient in closed
form, kept as a chain so that a gradient can be pulled back through them.

A view is the leaf after linear, shape-only operations (a dtype conversion, reshape,
transpose, broadcast, squeeze, copy, slice, a sharding constraint), after scalings by a number
written in the loss (``w * 0.5``, ``2.0 * w``, ``w / 3.0``, ``-w``: muP's or an equalised
learning rate's multipliers; the gradient of the leaf is that number times the view's, so a
ghost norm is its absolute value times the view's; a number the loss computes from such
numbers and from constants it holds, ``w * jnp.sqrt(1 / d)``, ``w * lax.rsqrt(d)``, is one
too: `fold` computes it while the loss is traced; so is a number traced outside the loss, the
same for every example, ``w * s`` with ``s`` an argument of the caller's `jit`: its value is
the step's, and the norm's scale is computed on the device), and inside the `scan` bodies it
enters (sliced as stacked layers, or the same at every step). An identity that only names or orders
it (``checkpoint_name`` for a rematerialisation policy, ``optimization_barrier``) leaves the
view as it is. `_trace` builds views while it walks the loss's jaxpr.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from optclip.per_example.ghost import _jaxprs

# Operations that give their operand's elements in the same order, with unit dimensions added
# or dropped (or none broadcast beyond size 1): XLA forms no copy for them.
RESHAPES = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})
VIEW_PRIMITIVES = RESHAPES | frozenset(
    {
        "convert_element_type",
        "transpose",
        "copy",
        "copy_p",
        "slice",
        "sharding_constraint",  # (`with_sharding_constraint` on a weight: where it is held)
    }
)
# Views whose gradient is the leaf's own elements permuted: a closed form keeps its layout.
PLAIN_PRIMITIVES = frozenset(
    {"convert_element_type", "transpose", "copy", "copy_p", "sharding_constraint"}
)
# Operations whose outputs are their operands, each its own (a name for rematerialisation
# policies, an ordering for XLA): a view passes through them unchanged.
IDENTITIES = frozenset({"name", "optimization_barrier"})
SCALINGS = frozenset({"mul", "div", "neg"})  # by a scalar written in the loss: `scaling`
# Arithmetic on numbers: what `fold` computes while the loss is traced (no collective, no
# random number, no loop, nothing whose value depends on where or when it runs).
ARITHMETIC = frozenset(
    {
        *("add", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min", "clamp"),
        *("pow", "integer_pow", "sqrt", "rsqrt", "cbrt", "square", "exp", "exp2", "log"),
        *("log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "atan2", "erf", "erf_inv"),
        *("floor", "ceil", "round", "is_finite", "convert_element_type", "copy", "copy_p"),
        *("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "select_n"),
    }
)
SLICED, CONSTANT = "scan slice", "scan constant"  # chain entries: a view enters a scan body
SCALED = "scale"  # chain entry: the view times a number (`View.scale`)


@dataclasses.dataclass(frozen=True)
class View:
    """A parameter leaf (its index among the parameter leaves) after `chain`: the
    ``(primitive, params)`` of the view operations applied to it, first to last; an entry into
    a scan's body is ``(SLICED or CONSTANT, its length)``, a scaling ``(SCALED, (primitive,
    params, number))``."""

    leaf: int
    shape: tuple = ()  # the leaf's
    chain: tuple = ()

    def then(self, eqn) -> View:
        return View(self.leaf, self.shape, self.chain + ((eqn.primitive, dict(eqn.params)),))

    def part(self, params: dict) -> View:
        """The view after a `slice` with `params` (a `split`'s part, a `dynamic_slice` at
        indices known while tracing: `parts`)."""
        return View(self.leaf, self.shape, self.chain + ((lax.slice_p, params),))

    def times(self, eqn, number) -> View:
        """The view after `eqn`, a `scaling` of it by `number` (None for a negation)."""
        scaled = (eqn.primitive, dict(eqn.params), number)
        return View(self.leaf, self.shape, self.chain + ((SCALED, scaled),))

    @property
    def scale(self):
        """The number the chain multiplies the leaf by (1.0 for none): the gradient of the
        leaf is this times the view's. A float, or a traced scalar where a number in the chain
        is traced outside the loss (`traced`)."""
        out = 1.0
        for primitive, params in self.chain:
            if primitive == SCALED:
                scaling, _, number = params
                if scaling.name == "neg":
                    out = -out
                else:
                    number = number if traced(number) else float(number)
                    out = out * number if scaling.name == "mul" else out / number
        return out

    @property
    def scale_key(self):
        """What `scale` is, comparable between views: the float, or for a chain with a traced
        number the chain's scalings with each traced number by identity (views scaled by the
        same traced value compare equal; the same value computed twice does not)."""
        numbers = [params for primitive, params in self.chain if primitive == SCALED]
        if not any(traced(number) for _, _, number in numbers):
            return self.scale
        return tuple(
            (s.name, ("traced", id(n)) if traced(n) else None if n is None else float(n))
            for s, _, n in numbers
        )

    def unscaled(self) -> View:
        """The view without its scalings (the leaf's gradient is `scale` times its)."""
        return View(self.leaf, self.shape, tuple(e for e in self.chain if e[0] != SCALED))

    def enter_scan(self, sliced: bool, length: int) -> View:
        """The view inside a `scan`'s body: one slice per iteration (`sliced`, an ``xs``
        operand) or the whole view at every iteration (a constant)."""
        return View(self.leaf, self.shape, self.chain + ((SLICED if sliced else CONSTANT, length),))

    def sliced_only(self) -> View:
        """The view without its entries into scans at which it is constant: its `stacked`
        value has the sliced levels only, and its cotangent there is the sum over the
        constant levels' steps."""
        return View(self.leaf, self.shape, tuple(e for e in self.chain if e[0] != CONSTANT))

    @property
    def depth(self) -> int:
        """How many `scan` bodies the view is inside."""
        return sum(p in (SLICED, CONSTANT) for p, _ in self.chain)

    def stacked(self, value):
        """The view of the leaf's `value` at every iteration of the scans it is inside:
        shape ``(*lengths, *view shape)`` (a constant is broadcast along its scan's axis)."""
        depth = 0
        for primitive, params in self.chain:
            if primitive == SLICED:
                depth += 1
            elif primitive == CONSTANT:
                value = jnp.broadcast_to(
                    jnp.expand_dims(value, depth),
                    (*value.shape[:depth], params, *value.shape[depth:]),
                )
                depth += 1
            elif primitive == SCALED:
                scaling, bound, number = params
                operands = () if number is None else (jnp.asarray(number, value.dtype),)
                value = scaling.bind(value, *operands, **bound)  # (shape (): any depth)
            else:
                bind = functools.partial(primitive.bind, **params)
                for _ in range(depth):
                    bind = jax.vmap(bind)
                value = bind(value)
        return value

    def unit_dims_dropped(self):
        """``(view, placed)``: this view before the last operations of its chain that only
        insert dimensions of size 1 (a `broadcast_in_dim`, `reshape` or `expand_dims`: the
        batch dimension of one an example keeps with ``keep_batch_dim``), and for each of
        that view's dimensions the dimension of this one it is."""
        view, placed = self, None
        while view.chain and view.chain[-1][0] in (lax.broadcast_in_dim_p, lax.reshape_p):
            primitive, params = view.chain[-1]
            before = View(view.leaf, view.shape, view.chain[:-1])
            shape = before.shape_of()
            at: list | None
            if primitive is lax.broadcast_in_dim_p:
                out, at = tuple(params["shape"]), list(params["broadcast_dimensions"])
            else:
                out = tuple(params["new_sizes"])
                at = None if params.get("dimensions") is not None else _matched(shape, out)
            if at is None or any(out[j] != n for j, n in zip(at, shape, strict=True)):
                break
            if any(out[j] != 1 for j in range(len(out)) if j not in at):
                break
            view, placed = before, at if placed is None else [placed[j] for j in at]
        return view, tuple(range(len(view.shape_of())) if placed is None else placed)

    def shape_of(self) -> tuple:
        """The view's shape (of one iteration of the scans it is inside, stacked)."""
        return jax.eval_shape(self.stacked, jax.ShapeDtypeStruct(self.shape, jnp.float32)).shape

    def leaf_dims(self):
        """For a chain of plain views only (dtype conversions, transposes, the scans' slices,
        slices and squeezes): ``(dims, levels, pins)``, the leaf dimension of each view
        dimension, for each enclosing scan the leaf dimension it slices (None for a constant),
        and ``((leaf dimension, (start, stop, stride)), ...)`` for the parts of the leaf's
        dimensions the view takes (a single index, squeezed or not, or a range: a part split off
        a fused weight). None for any other chain (a reshape, a broadcast)."""
        dims, shape = list(range(len(self.shape))), list(self.shape)
        levels: list[int | None] = []
        pins: dict[int, tuple] = {}
        for primitive, params in self.chain:
            if primitive == SLICED:
                levels.append(dims.pop(0))
                shape.pop(0)
            elif primitive == CONSTANT:
                levels.append(None)
            elif primitive == SCALED:
                continue  # (elementwise: every element scaled alike)
            elif primitive.name == "transpose":
                dims = [dims[i] for i in params["permutation"]]
                shape = [shape[i] for i in params["permutation"]]
            elif primitive.name == "slice":
                strides = params["strides"] or (1,) * len(shape)
                for d, (lo, hi, st) in enumerate(
                    zip(params["start_indices"], params["limit_indices"], strides, strict=True)
                ):
                    if (lo, hi, st) == (0, shape[d], 1):
                        continue
                    taken = range(*pins.get(dims[d], (0, shape[d], 1)))[lo:hi:st]
                    pins[dims[d]] = (taken.start, taken.stop, taken.step)  # (of a part too)
                    shape[d] = len(taken)
            elif primitive.name == "squeeze":
                for d in params["dimensions"]:
                    pins.setdefault(dims[d], (0, 1, 1))
                dims = [x for d, x in enumerate(dims) if d not in params["dimensions"]]
                shape = [x for d, x in enumerate(shape) if d not in params["dimensions"]]
            elif primitive.name not in PLAIN_PRIMITIVES:
                return None
        return tuple(dims), tuple(levels), tuple(sorted(pins.items()))


def _matched(shape, out):
    """For a reshape of `shape` to `out` that only inserts dimensions of size 1: the dimension
    of `out` of each of `shape`'s, in order (None for any other reshape)."""
    at, j = [], 0
    for n in shape:
        while j < len(out) and out[j] != n:
            if out[j] != 1:
                return None
            j += 1
        if j == len(out):
            return None
        at.append(j)
        j += 1
    return at if all(n == 1 for n in out[j:]) else None


def scaling(eqn, used, known):
    """The number a `mul`, `div` or `neg` multiplies its one view by, when that number is
    written in the loss (a scalar literal: ``w * 0.5``, ``2.0 * w``, ``w / 3.0``), computed
    from such numbers (`known`: `fold`'s) or traced outside the loss (a scalar the caller's
    `jit` traces, the same for every example: returned traced, its value the step's), None
    for ``-w``, else False (a product of two views, a scale that depends on the data or the
    parameters, a division by the view or by a written 0, a written number not finite, or a
    `mul` by an array: each a site)."""
    name = eqn.primitive.name
    if name not in SCALINGS or len(used) != 1 or not _jaxprs.is_float(eqn.outvars[0]):
        return False
    pos = used[0][0]
    if name == "neg":
        return None
    other = eqn.invars[1 - pos]
    value = constant(other, known)
    if value is None or value.shape or not jnp.issubdtype(value.dtype, jnp.floating):
        return False
    if traced(value):
        return value if name == "mul" or pos == 0 else False
    number = float(value)
    if not math.isfinite(number) or (name == "div" and (pos != 0 or number == 0)):
        return False  # (a site: JAX's own infinities and NaNs, materialised)
    return value


def parts(eqn, used, known) -> list[dict] | None:
    """The `slice` parameters of each output of `eqn` where it takes parts of its one view at
    indices known while tracing: a `split` (``jnp.split`` of a fused gate or QKV weight), or a
    `dynamic_slice` whose start indices are written in the loss or computed from such numbers
    (KerasHub's positions, ``lax.dynamic_slice(pos, (0, 0), (T, d))``: clamped as
    `dynamic_slice` clamps them). None for any other equation."""
    name = eqn.primitive.name
    if len(used) != 1 or used[0][0] != 0 or not _jaxprs.is_float(eqn.outvars[0]):
        return None
    shape = tuple(eqn.invars[0].aval.shape)
    if name == "split":
        axis, sizes = eqn.params["axis"], eqn.params["sizes"]
        out = []
        for start, size in zip(np.cumsum((0, *sizes))[:-1], sizes, strict=True):
            starts = tuple(int(start) if d == axis else 0 for d in range(len(shape)))
            out.append(
                _slice(starts, tuple(int(size) if d == axis else n for d, n in enumerate(shape)))
            )
        return out
    if name != "dynamic_slice":
        return None
    values = [constant(v, known) for v in eqn.invars[1:]]
    if any(v is None or traced(v) or np.shape(v) for v in values):
        return None
    sizes = tuple(eqn.params["slice_sizes"])
    clamped = (min(max(int(v), 0), n - k) for v, n, k in zip(values, shape, sizes, strict=True))
    return [_slice(tuple(clamped), sizes)]


def _slice(starts: tuple, sizes: tuple) -> dict:
    """The parameters of the `slice` of `sizes` at `starts`."""
    limits = tuple(a + k for a, k in zip(starts, sizes, strict=True))
    return {"start_indices": starts, "limit_indices": limits, "strides": None}


def constant(var, known):
    """The value of `var` where it is a literal or in `known` (a NumPy array, or a traced
    scalar: `held`), else None."""
    if isinstance(var, jcore.Literal):
        return np.asarray(var.val, getattr(var.aval, "dtype", None))
    return known.get(var) if isinstance(var, jcore.Var) else None


def held(variables, values) -> dict:
    """``{variable: value}`` for the scalars among `values` (a jaxpr's consts, a call's
    operands: numbers the loss holds or is passed). A scalar held on a device is read once,
    while tracing (`_while_tracing`); one traced outside the loss (a `Tracer` of the caller's
    `jit`, `vmap` or `scan`: not an argument of the loss, so the same for every example) is
    kept traced: its value is known when the step runs, in the trace the step runs in."""
    out = {}
    with _while_tracing():
        for var, value in zip(variables, values, strict=True):
            if not isinstance(var, jcore.Var) or value is None or np.shape(value):
                continue
            if traced(value):
                if _scalar(value):
                    out[var] = value
            else:
                out[var] = np.asarray(value)
    return out


def traced(value) -> bool:
    """Whether a known number is traced outside the loss (its value the step's)."""
    return isinstance(value, jax.core.Tracer)


def fold(eqn, known) -> bool:
    """Computes `eqn` now, into `known`, where its operands are all `constant` and it makes
    numbers from numbers: scalars in and out, by arithmetic (`ARITHMETIC`) or a call of such
    equations (``jnp.clip``). ``jnp.sqrt(1 / d)`` and its conversion to the weight's dtype
    are, so that a weight scaled by it is a view; a collective (``lax.psum(1, axis)``, whose
    value is the mesh's), a random number or a loop is not. Returns whether it did. The
    traced loss computes it again; the value is the same to rounding. With a number traced
    outside the loss among its operands it is computed in the caller's trace (traced too)."""
    values = [constant(v, known) for v in eqn.invars]
    if any(v is None or not _scalar(v) for v in values):
        return False
    if not all(_scalar(v.aval) for v in eqn.outvars):
        return False
    called = _jaxprs.sub_jaxpr(eqn) if eqn.primitive.name in _jaxprs.CALLS else None
    if called is not None:
        inner = held(called[0].constvars, called[1]) | held(called[0].invars, values)
        if not all(fold(e, inner) for e in called[0].eqns):
            return False
        outs = [constant(v, inner) for v in called[0].outvars]
        if any(o is None for o in outs):
            return False
    elif eqn.primitive.name in ARITHMETIC and any(traced(v) for v in values):
        out = eqn.primitive.bind(*values, **eqn.params)  # (in the caller's trace, with them)
        outs = list(out) if eqn.primitive.multiple_results else [out]
    elif eqn.primitive.name in ARITHMETIC:
        with _while_tracing(), jax.ensure_compile_time_eval():
            out = eqn.primitive.bind(*values, **eqn.params)
            outs = [np.asarray(o) for o in (out if eqn.primitive.multiple_results else [out])]
    else:
        return False
    known.update(zip(eqn.outvars, outs, strict=True))
    return True


def _while_tracing():
    """Where `held` and `fold` compute and read numbers: while the loss is traced, once per
    compilation, never on the step. The scalars go to the device and back then, as any
    constant computed eagerly does; under ``jax.transfer_guard("disallow")`` (optclip's promise
    of no host sync, which covers tracing too) these transfers, and only these, are allowed."""
    return jax.transfer_guard("allow")


def _scalar(x) -> bool:
    """Whether `x` (an array or an abstract value) is a number: shape (), a numeric dtype."""
    return not getattr(x, "shape", (1,)) and _numeric(getattr(x, "dtype", None))


def _numeric(dtype) -> bool:
    if dtype is None:
        return False
    return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)
