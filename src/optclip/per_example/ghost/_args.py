"""The arguments of `clipped_grad`, checked, and the per-example function they describe.

jax_privacy's conventions (2.0): `argnums` are differentiated and have no batch axis;
`batch_argnums` (and every keyword argument of the returned function) are split along their
leading axis, one example each, passed with a leading axis of size 1 when `keep_batch_dim`;
the key at `prng_argnum` is split into one key per example.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optclip import _checks

METHODS = ("auto", "vmap")


def as_argnums(value, name: str) -> tuple[int, ...]:
    """An int or a sequence of ints as a tuple, checked: each >= 0."""
    items = (value,) if isinstance(value, (int, np.integer)) else value
    if (
        isinstance(value, bool)
        or not isinstance(items, Sequence)
        or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in items)
    ):
        raise TypeError(f"`{name}` must be an int or a sequence of ints, got {value!r}.")
    items = tuple(int(i) for i in items)
    if any(i < 0 for i in items):
        raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
    return items


def check_static(
    argnums, batch_argnums, normalize_by, l2_clip_norm, method, prng_argnum, microbatch_size
):
    """The checks `clipped_grad` makes when it is called (jax_privacy's, in optclip's words)."""
    args = as_argnums(argnums, "argnums")
    batch = as_argnums(batch_argnums, "batch_argnums")
    if not args:
        raise ValueError("`argnums` must name at least one argument, got ().")
    if not batch:
        raise ValueError("`batch_argnums` must name at least one argument, got ().")
    shared = sorted(set(args) & set(batch))
    if shared:
        raise ValueError(
            f"`argnums` ({argnums!r}) and `batch_argnums` ({batch_argnums!r}) share {shared}: "
            "the differentiated arguments have no batch axis."
        )
    if isinstance(normalize_by, numbers.Real) and not float(normalize_by) > 0:
        raise ValueError(f"`normalize_by` must be > 0, got {normalize_by!r}.")
    _checks.check_scalar(l2_clip_norm, "l2_clip_norm")
    value = _checks.concrete(l2_clip_norm)
    if value is not None and float(value) < 0:
        raise ValueError(
            f"`l2_clip_norm` must be >= 0 (inf for no clipping), got {l2_clip_norm!r}."
        )
    _checks.check_choice(method, "method", METHODS)
    if prng_argnum is not None:
        (key,) = as_argnums(prng_argnum, "prng_argnum")
        if key in args or key in batch:
            raise ValueError(f"`prng_argnum` ({key}) must not be in `argnums` or `batch_argnums`.")
    if microbatch_size is not None:
        _checks.check_count(microbatch_size, "microbatch_size", True)
    return args, batch


def check_leaves(args, argnums, batch, what: str) -> None:
    """The differentiated arguments are given and hold floating-point or complex numbers, the
    batch arguments numbers (`_checks`' leaf checks), each leaf named by its argument's place
    and its path."""
    if max(argnums) >= len(args):
        raise TypeError(
            f"`argnums` names argument {max(argnums)}, but {what} was given {len(args)} "
            "positional arguments."
        )
    for i in argnums:
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            where = (jax.tree_util.SequenceKey(i), *path)
            _checks.check_float_leaf(where, leaf, f"{what} differentiates argument {i}: it")
    for i in sorted(set(batch) - set(argnums)):
        if i < len(args):
            _checks.check_leaves(args[i], what, prefix=(jax.tree_util.SequenceKey(i),))


def batch_size(args, kwargs, batch) -> int:
    """The common leading size of the batch arguments and keyword arguments, checked."""
    if len(args) <= max(batch):
        raise ValueError(
            f"`batch_argnums` names argument {max(batch)}, but the function was given "
            f"{len(args)} positional arguments."
        )
    sizes: dict[int, str] = {}
    for i in batch:
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            shape = np.shape(leaf)
            if not shape:
                raise ValueError(
                    f"batch argument {i} needs a leading batch axis on every leaf; leaf "
                    f"`{_checks.leaf_name(path)}` is 0-d."
                )
            sizes.setdefault(shape[0], f"argument {i}, leaf `{_checks.leaf_name(path)}`")
    for path, leaf in jax.tree_util.tree_flatten_with_path(kwargs)[0]:
        if not np.shape(leaf):
            raise ValueError(
                f"keyword arguments are split into examples like the batch; keyword argument "
                f"`{_checks.leaf_name(path)}` is 0-d (pass it positionally, outside "
                "`batch_argnums`, to give every example the same value)."
            )
        sizes.setdefault(np.shape(leaf)[0], f"keyword `{_checks.leaf_name(path)}`")
    if not sizes:
        names = ", ".join(str(i) for i in batch)
        raise ValueError(
            f"batch argument {names} holds no arrays (nor do the keyword arguments): there is "
            "no batch to split into examples."
        )
    if len(sizes) != 1:
        listed = "; ".join(f"{size} ({where})" for size, where in sizes.items())
        raise ValueError(f"the batch arguments must share one batch size, got {listed}.")
    return next(iter(sizes))


def padding_mask(value, size: int):
    """`is_padding_example` as a (B,) bool array (all False if None), checked."""
    if value is None:
        return jnp.zeros((size,), bool)
    shape = np.shape(value)
    dtype = jnp.result_type(value)
    if shape != (size,) or dtype != jnp.bool_:
        raise ValueError(
            f"`is_padding_example` must be a bool array of shape ({size},) (one flag per "
            f"example), got {dtype} of shape {shape}."
        )
    return jnp.asarray(value)


def split_keys(args, prng_argnum, size: int):
    """`args` with the key(s) at `prng_argnum` split into one per example."""
    if prng_argnum is None:
        return args
    args = list(args)
    args[prng_argnum] = jax.tree.map(lambda k: jax.random.split(k, size), args[prng_argnum])
    return tuple(args)


def in_axes(count: int, batch, prng_argnum):
    """The `vmap` axes of the positional arguments: 0 for batch arguments and keys."""
    mapped = set(batch) | ({prng_argnum} if prng_argnum is not None else set())
    return tuple(0 if i in mapped else None for i in range(count))


def per_example(fun, has_aux: bool, batch, keep_batch_dim: bool):
    """``one(args, kwargs) -> (loss, aux)`` for one example (`args` the positional arguments
    with one example's slices, `kwargs` one example's keyword arguments)."""

    def one(args, kwargs):
        args = list(args)
        if keep_batch_dim:
            for i in batch:
                args[i] = jax.tree.map(lambda x: jnp.expand_dims(x, 0), args[i])
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, ())
        loss = jnp.asarray(loss)
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(
                "`fun` must return a real scalar loss for one example (with `has_aux`, as "
                f"the first of `(loss, aux)`), got {loss.dtype} of shape {loss.shape}."
            )
        return loss, aux

    return one
