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
    shape = getattr(value, "shape", None)
    if shape is None:
        shape = np.shape(value)
    return tuple(shape)


def check_scalar(value, name: str, *, allow_nan: bool = False):
    """Checks that a threshold is a 0-d real number, not a concrete NaN; returns it unchanged.

    A NaN threshold is an error when it is known now (a traced NaN makes the clipped values
    NaN, see `_functional.clip_scale`). `allow_nan` is for a norm given in place of the computed
    one (`use_norm`), which may be NaN as any norm may.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a real number, got a bool ({value!r}).")
    if not isinstance(value, (numbers.Real, np.ndarray, np.generic, jax.Array)):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}: {value!r}.")
    shape = _shape_of(value)
    if shape != ():
        raise ValueError(f"`{name}` must be a scalar, got an array of shape {shape}.")
    dtype = jnp.result_type(value)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"`{name}` must be a real number, got dtype {dtype}.")
    if not allow_nan:
        check_not_nan(value, name, THRESHOLD_ACCEPTED)
    return value


def check_bool(value, name: str) -> bool:
    """A switch that decides the program (Python control flow): a Python or NumPy bool, never
    an array that could be traced."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a bool, got {type(value).__name__}: {value!r}.")
    return bool(value)


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
    text = jax.tree_util.keystr(tuple(path))
    return text if text else "<array>"


def check_float_leaf(path, leaf, what: str) -> None:
    """Norm modes need floating-point or complex leaves."""
    dtype = jnp.result_type(leaf)
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)):
        raise TypeError(
            f"{what} needs floating-point or complex leaves; leaf `{leaf_name(path)}` "
            f"has dtype {dtype}."
        )


def normalize_axes(axes, path, ndim: int) -> tuple[int, ...]:
    """`axes` (an int or a sequence of ints, negatives from the end) as sorted non-negative ints."""
    if is_traced(axes):
        raise TypeError(
            "`axes` must be static Python ints, got a traced value (with "
            "`optax.inject_hyperparams`, pass `static_args=('axes',)`)."
        )
    if isinstance(axes, (numbers.Integral, np.integer)) or (
        isinstance(axes, (np.ndarray, jax.Array)) and np.ndim(axes) == 0
    ):
        axes = (axes,)
    try:
        items = [int(a) for a in axes]
    except TypeError:
        raise TypeError(f"`axes` must be an int or a sequence of ints, got {axes!r}.") from None
    out = []
    for a in items:
        if not -ndim <= a < ndim:
            raise ValueError(
                f"`axes` {tuple(items)} is out of range for leaf `{leaf_name(path)}` "
                f"with {ndim} dimension(s)."
            )
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"`axes` {tuple(items)} repeats an axis for leaf `{leaf_name(path)}`.")
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
