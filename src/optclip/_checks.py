"""Argument validation and its messages.

Every check here runs on what is known when the function is called: concrete Python or NumPy
values are checked eagerly, traced values (under `jit`, `vmap`, `inject_hyperparams`) only for
what their abstract type says (shape, dtype).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

ORD_ACCEPTED = "1, 2, inf (float('inf') or numpy.inf) or any number p > 0"
THRESHOLD_ACCEPTED = "a threshold is a number (negative means zero, inf means no clipping)"
BOUND_ACCEPTED = "a bound is a number or an array of numbers (None or inf for no bound)"


class _NotGiven:
    """The default of an argument whose absence means something other than ``None``."""

    def __repr__(self) -> str:
        return "<not given>"

    def __reduce__(self) -> str:
        return "NOT_GIVEN"  # copies and pickles are the one instance (compared with `is`)


NOT_GIVEN = _NotGiven()


def is_traced(value) -> bool:
    """True for a value whose contents are not known now (a tracer)."""
    return isinstance(value, jax.core.Tracer)


def concrete(value):
    """`value` as a NumPy array if it is known now, else None."""
    if is_traced(value):
        return None
    try:
        return np.asarray(value)
    except Exception:  # noqa: BLE001 - anything NumPy cannot hold is not concrete here.
        return None


def _shape_of(value):
    return tuple(np.shape(value))  # (`value.shape` where it has one)


def check_scalar(value, name: str, *, allow_nan: bool = False):
    """Checks that a threshold is a 0-d real number, not a concrete NaN; returns it unchanged.

    A NaN threshold is an error when it is known now (a traced NaN makes the clipped values
    NaN, see `_scale.clip_scale`). `allow_nan` is for a norm given in place of the computed
    one (`use_norm`), which may be NaN as any norm may.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a real number, got a bool ({value!r}).")
    if not isinstance(value, (numbers.Real, np.ndarray, np.generic, jax.Array)):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}: {value!r}.")
    shape = _shape_of(value)
    if shape != ():
        raise ValueError(f"`{name}` must be a scalar, got an array of shape {shape}.")
    _check_int_range(value, name)
    dtype = jnp.result_type(value)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"`{name}` must be a real number, got dtype {dtype}.")
    if not allow_nan:
        check_not_nan(value, name, THRESHOLD_ACCEPTED)
    return value


def _check_int_range(value, name: str) -> None:
    """A Python int must be a number some float dtype can hold (it is converted through
    float64, see `as_array`): `2**40` is fine, `10**400` is not."""
    if isinstance(value, numbers.Integral) and not isinstance(value, np.integer):
        try:
            float(value)
        except OverflowError:
            raise ValueError(
                f"`{name}` is too large for any float dtype: got an int of "
                f"{len(str(abs(int(value))))} digits."
            ) from None


def as_array(value, dtype):
    """A checked number or array of numbers as a JAX array of `dtype`.

    Concrete integers are converted on the host, exactly: to a float dtype through float64 (a
    Python or NumPy int beyond int32 is the number it says, where JAX would raise
    `OverflowError` or, for a NumPy int64 without x64, silently wrap around), to an integer
    dtype saturated at its range. Traced values and JAX arrays are cast by JAX.
    """
    dtype = jnp.dtype(dtype)
    if isinstance(value, jax.Array):
        return value.astype(dtype)
    into_int = jnp.issubdtype(dtype, jnp.integer)
    if isinstance(value, numbers.Integral) and not isinstance(value, (np.integer, bool)):
        if into_int:
            info = jnp.iinfo(dtype)
            value = min(max(int(value), int(info.min)), int(info.max))
        else:
            value = float(value)
    known = np.asarray(value)
    if np.issubdtype(known.dtype, np.integer):
        if into_int:
            ours, theirs = jnp.iinfo(dtype), np.iinfo(known.dtype)
            lo, hi = max(int(ours.min), int(theirs.min)), min(int(ours.max), int(theirs.max))
            known = np.clip(known, lo, hi)
        else:
            known = known.astype(np.float64)
    with np.errstate(over="ignore"):  # a float64 beyond the target's range is inf there
        return jnp.asarray(known.astype(dtype))


def check_bool(value, name: str) -> bool:
    """A switch that decides the program (Python control flow): a Python or NumPy bool, never
    an array that could be traced."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if is_traced(value):
        raise TypeError(
            f"`{name}` decides the structure of the computation, so it must be a Python bool "
            f"when the function is traced; got a traced value ({type(value).__name__}). Make it "
            f"a static argument: `jax.jit(f, static_argnames=('{name}',))` (with "
            f"`optax.inject_hyperparams`, `static_args=('{name}',)`)."
        )
    raise TypeError(f"`{name}` must be a Python bool, got {type(value).__name__}: {value!r}.")


def check_not_nan(value, name: str, accepted: str) -> None:
    """A concrete threshold or bound must not be NaN (traced values are not looked at)."""
    known = concrete(value)
    if known is None or not jnp.issubdtype(known.dtype, jnp.floating):
        return
    if np.any(np.isnan(known.astype(np.float64))):
        raise ValueError(f"`{name}` must not be NaN, got {value!r}; {accepted}.")


def is_schedule(value) -> bool:
    """An Optax schedule: a callable of the step count (a JAX array is callable too: not one)."""
    return callable(value) and not isinstance(value, jax.Array)


def check_threshold(value, name: str):
    """A threshold: a 0-d real number, or an Optax schedule (a callable of the step count)."""
    if is_schedule(value):
        return value
    return check_scalar(value, name)


def check_ord(ord):
    """Normalises a norm order to a Python float, or returns a traced order unchanged.

    `optax.inject_hyperparams` turns every numeric factory argument into an array, so a traced
    order is accepted here and dispatched at run time by the norm.
    """
    if isinstance(ord, (bool, np.bool_)):
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {ord!r}.")
    if isinstance(ord, str):
        if ord.lower() in ("inf", "infinity"):
            return math.inf
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {ord!r}.")
    if is_traced(ord):
        if _shape_of(ord) != ():
            raise ValueError(f"`ord` must be a scalar, got an array of shape {_shape_of(ord)}.")
        return ord
    value = concrete(ord)
    if value is None or value.shape != () or not np.issubdtype(value.dtype, np.number):
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {ord!r}.")
    if np.iscomplexobj(value):
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {ord!r}.")
    p = float(value)
    if not p > 0:  # also rejects NaN
        raise ValueError(f"`ord` must be {ORD_ACCEPTED}; got {ord!r}.")
    return p


def check_choice(value, name: str, accepted: Sequence[str]) -> str:
    """A string option that must be one of `accepted`."""
    if not isinstance(value, str) or value not in accepted:
        listed = ", ".join(repr(a) for a in accepted)
        raise ValueError(f"`{name}` must be one of {listed}; got {value!r}.")
    return value


def leaf_name(path) -> str:
    """A readable name for a leaf's path: `['layer'][0]`, or `<array>` for a bare array."""
    return jax.tree_util.keystr(tuple(path)) or "<array>"


def check_array_leaf(path, leaf, what: str) -> None:
    """The one check of a leaf, at every entry point: a JAX array, a Python number, or anything
    with a dtype JAX has (NumPy arrays and scalars, `jax.ShapeDtypeStruct`). Anything else (a
    str, bytes, a NumPy array of objects or strings) is named with its path and what it holds,
    not read as a dtype (``jnp.result_type("int32")`` is int32)."""
    if isinstance(leaf, (jax.Array, bool, int, float, complex)) or hasattr(leaf, "__jax_array__"):
        return
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and (jnp.issubdtype(dtype, jax.dtypes.extended) or dtype == np.bool_):
        return
    if dtype is not None and jnp.issubdtype(dtype, jnp.number):
        if np.dtype(dtype).itemsize <= (16 if jnp.issubdtype(dtype, jnp.complexfloating) else 8):
            return  # (not a long double, which JAX does not have)
    kind = type(leaf).__name__ + ("" if dtype is None else f" of dtype {dtype}")
    text = repr(leaf) if len(repr(leaf)) <= 60 else repr(leaf)[:57] + "..."
    raise TypeError(
        f"{what} needs numbers or arrays of numbers as leaves; leaf `{leaf_name(path)}` is "
        f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}: {text}."
    )


def check_leaves(tree, what: str, prefix: tuple = ()) -> list:
    """`tree`'s ``(path, leaf)`` pairs, each leaf checked (named by `prefix` and its path)."""
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in paths_and_leaves:
        check_array_leaf((*prefix, *path), leaf, what)
    return paths_and_leaves


def check_float_leaf(path, leaf, what: str) -> None:
    """Norm modes need floating-point or complex leaves."""
    check_array_leaf(path, leaf, what)
    dtype = jnp.result_type(leaf)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)):
        raise TypeError(
            f"{what} needs floating-point or complex leaves; leaf `{leaf_name(path)}` "
            f"has dtype {dtype}."
        )


def _is_int(value) -> bool:
    """A Python or NumPy int, or a concrete 0-d integer array; not a bool."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (np.ndarray, jax.Array)):
        return value.ndim == 0 and jnp.issubdtype(value.dtype, jnp.integer)
    return isinstance(value, (numbers.Integral, np.integer))


def check_axes(axes, name: str = "axes"):
    """Array axes: None, an int or a sequence of ints (negative from the end), as a tuple of
    Python ints (None stays None). Nothing is truncated: ``[0.5]``, ``["1"]``, ``True`` or a
    float array are errors, and a traced value says to make it static."""
    if axes is None:
        return None
    traced = is_traced(axes) or (
        isinstance(axes, (list, tuple)) and any(is_traced(a) for a in axes)
    )
    if traced:
        raise TypeError(
            f"`{name}` must be static Python ints, got a traced value (with "
            f"`optax.inject_hyperparams`, pass `static_args=('{name}',)`; with `jax.jit`, "
            f"`static_argnames=('{name}',)`)."
        )
    if _is_int(axes):
        return (int(axes),)
    try:
        items = None if isinstance(axes, (str, bytes)) else list(axes)
    except TypeError:
        items = None
    if items is None or not all(_is_int(a) for a in items):
        raise TypeError(f"`{name}` must be None, an int or a sequence of ints, got {axes!r}.")
    return tuple(int(a) for a in items)


def normalize_axes(axes: tuple, path, ndim: int, name: str = "axes") -> tuple[int, ...]:
    """Axes checked by `check_axes` as sorted non-negative ints for a leaf of `ndim`
    dimensions (negatives count from the end)."""
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(
                f"`{name}` {tuple(axes)} is out of range for leaf `{leaf_name(path)}` "
                f"with {ndim} dimension(s)."
            )
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"`{name}` {tuple(axes)} repeats an axis for leaf `{leaf_name(path)}`.")
    return tuple(sorted(out))


def check_bounds(clip_value_min, clip_value_max) -> None:
    """Bounds are real numbers or arrays, or None (no bound); concrete ones are not NaN and
    satisfy `min <= max`."""
    for value, name in ((clip_value_min, "clip_value_min"), (clip_value_max, "clip_value_max")):
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (numbers.Real, np.ndarray, np.generic, jax.Array)
        ):
            raise TypeError(f"`{name}` must be a real number, an array or None, got {value!r}.")
        _check_int_range(value, name)
        dtype = np.dtype(value.dtype) if hasattr(value, "dtype") else None
        if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"`{name}` must be real: a complex bound has no order (its imaginary part would "
                f"be dropped), got dtype {dtype}."
            )
        if dtype is not None and not (
            jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
        ):
            raise TypeError(f"`{name}` must be a real number or array, got dtype {dtype}.")
        check_not_nan(value, name, BOUND_ACCEPTED)
    if clip_value_min is None or clip_value_max is None:
        return
    lo, hi = concrete(clip_value_min), concrete(clip_value_max)
    if lo is None or hi is None:
        return
    try:
        bad = np.any(lo > hi)
    except ValueError:
        raise ValueError(
            f"`clip_value_min` (shape {lo.shape}) and `clip_value_max` (shape {hi.shape}) "
            "do not broadcast together."
        ) from None
    if bad:
        raise ValueError(
            f"`clip_value_min` must be <= `clip_value_max`, got {clip_value_min!r} > "
            f"{clip_value_max!r}."
        )


def check_number(value, name: str, accepted: str, ok) -> None:
    """A 0-d real number; if concrete, `ok(float(value))` must hold (NaN fails it, with the
    message saying what is accepted)."""
    check_scalar(value, name, allow_nan=True)
    known = concrete(value)
    if known is not None and not ok(float(known)):
        raise ValueError(f"`{name}` must be {accepted}, got {value!r}.")


def check_count(value, name: str, static: bool) -> None:
    """A whole number >= 1. `static` ones set a shape and must be known when the factory runs."""
    if static and isinstance(value, jax.Array):
        raise TypeError(
            f"`{name}` sets the shape of the state and must be a Python int, got a JAX array "
            f"(with `optax.inject_hyperparams`, pass `static_args=('{name}',)`)."
        )
    if is_traced(value):
        if np.shape(value) != () or not jnp.issubdtype(value.dtype, jnp.integer):
            raise ValueError(
                f"`{name}` must be an int >= 1, got a traced {value.dtype} "
                f"array of shape {np.shape(value)}."
            )
        return
    known = concrete(value)
    if (
        isinstance(value, (bool, np.bool_))
        or known is None
        or known.shape != ()
        or not np.issubdtype(known.dtype, np.integer)
        or int(known) < 1
    ):
        raise ValueError(f"`{name}` must be an int >= 1, got {value!r}.")


def check_settings(value, name: str, settings_type):
    """An argument that switches a feature on with its settings: None or False (off), True (the
    default settings) or an instance of `settings_type`; returns the settings or None."""
    if value is None or value is False:
        return None
    if value is True:
        return settings_type()
    if isinstance(value, settings_type):
        return value
    raise TypeError(
        f"`{name}` must be None, True (the default settings) or an "
        f"`optclip.{settings_type.__name__}(...)`, got {type(value).__name__}: {value!r}."
    )


def factory(fn):
    """Marks `fn` as a factory of transformations. Passed uncalled where a transformation
    belongs (``optax.chain(optclip.global_clip, optax.adam(1e-3))``), optax reads its `init` and
    `update`; both raise a `TypeError` that says to call it, where optax alone would fail with
    "'function' object has no attribute 'init'"."""

    def uncalled(*args, **kwargs):
        raise TypeError(
            f"`optclip.{fn.__name__}` is a factory of transformations, not a transformation: "
            f"call it with its arguments (`optclip.{fn.__name__}(...)`) where an optax "
            "transformation is expected."
        )

    uncalled.factory = fn  # type: ignore[attr-defined]
    fn.init = uncalled
    fn.update = uncalled
    return fn


def is_factory(value) -> bool:
    """Whether `value` is one of optclip's factories (`factory`), whose `init` and `update`
    are there only to raise."""
    return getattr(getattr(value, "init", None), "factory", None) is value
