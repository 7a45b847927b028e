"""Which mesh axes each leaf is split over: `axis_name`, checked against what JAX knows.

Inside `jax.shard_map` (and `jax.pmap`) the code sees one device's piece of each array, and a
norm of pieces is only the norm of the whole if the pieces' partial sums are all-reduced over
exactly the mesh axes that split them. `axis_name` says which axes those are; this module turns
it into a sorted tuple of axis names per leaf and checks it:

* every named axis must be bound (a mesh axis of the enclosing `shard_map`/`pmap`);
* inside `shard_map` with `check_vma=True` (its default) JAX tracks which manual axes each value
  varies over. A leaf declared split over an axis it does not vary over is replicated there (its
  norm would be counted once per device), and a leaf that varies over an axis that is not
  declared would be clipped by a per-device norm: both are errors;
* with ``axis_name=None`` (or ``"auto"``) the axes are read from that tracking, so inside
  `shard_map` nothing needs to be declared. Outside any manual axes there is nothing to reduce
  (under `jit`, sharded arrays are global arrays).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from optclip import _checks, _errors
from optclip.norms import _reductions

AUTO = "auto"


class AxisNameError(ValueError):
    """`axis_name` does not describe how the updates are split over the mesh axes: a leaf is
    declared split over an axis it is replicated on (its norm would be counted once per
    device), or not declared split over an axis it varies over."""


# ----------------------------------------------------------------------------------------------
# What JAX knows about the axes here.


def bound_axis_names() -> tuple:
    """The mesh axes bound where this runs (by `shard_map`, `pmap` or a named `vmap`)."""
    try:
        from jax._src import core  # no public accessor for the axis environment

        return tuple(core.get_axis_env().axis_sizes)
    except Exception:  # noqa: BLE001 - fall back on the public view of the manual mesh axes
        return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def _is_bound(name) -> bool:
    try:
        lax.axis_size(name)
    except NameError:
        return False
    return True


def tracks_variation() -> bool:
    """Whether JAX tracks here which mesh axes each value varies over (`shard_map` with
    `check_vma=True`). Under `pmap`, or `shard_map(check_vma=False)`, it does not."""
    try:
        from jax._src import config  # shard_map's own switch: no public getter

        return bool(config._check_vma.value) and bool(bound_axis_names())
    except Exception:  # noqa: BLE001 - an older or newer JAX without it: nothing is checked
        return False


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over (empty outside `shard_map` or for a constant)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax < 0.10
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


# ----------------------------------------------------------------------------------------------
# `axis_name` -> the part that describes each leaf.

_ACCEPTED = (
    "None, 'auto', a mesh axis name (a str), a tuple of names, a PartitionSpec, or a pytree "
    "of PartitionSpecs / names / None matching the updates (such as shard_map's `in_specs`)"
)


def is_axis_spec(value) -> bool:
    """What describes one leaf (or a subtree) in `axis_name`: None, a mesh axis name, a
    non-empty tuple of names, or a `PartitionSpec`."""
    return (
        value is None
        or isinstance(value, (str, PartitionSpec))
        or (isinstance(value, tuple) and all(isinstance(v, str) for v in value) and value != ())
    )


def _spec_entry_ok(entry) -> bool:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED or isinstance(entry, str):
        return True
    return isinstance(entry, tuple) and all(isinstance(e, str) for e in entry)


def check_axis_name(axis_name):
    """`axis_name`'s type, checked when it is given (its match with the updates and the mesh is
    checked where they are known); returned unchanged."""
    for spec in jax.tree.leaves(axis_name, is_leaf=is_axis_spec):
        bad = None
        if not is_axis_spec(spec):
            bad = spec
        elif isinstance(spec, PartitionSpec):
            bad = next((e for e in spec if not _spec_entry_ok(e)), None)
        if bad is not None:
            where = "" if bad is axis_name else f" (it holds {bad!r})"
            raise TypeError(f"`axis_name` must be {_ACCEPTED}; got {axis_name!r}{where}.")
    return axis_name


def spec_axes(spec) -> tuple:
    """The mesh axis names a `PartitionSpec`, a name, a tuple of names or None splits over."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        return (spec,)
    names = []
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        names.extend([entry] if isinstance(entry, str) else list(entry))
    for name in names:
        if not isinstance(name, str):
            raise ValueError(
                f"`axis_name` entries must be mesh axis names, got {name!r} in {spec}."
            )
    return tuple(sorted(set(names)))


class _LeafSpecs:
    """The specs of the leaves under one `axis_name` entry: an opaque pytree leaf, so that list
    nodes in `axis_name` (a list of `PartitionSpec`s) are not mistaken for results."""

    def __init__(self, specs: list):
        self.specs = specs


def is_auto(axis_name) -> bool:
    return axis_name is None or (isinstance(axis_name, str) and axis_name == AUTO)


def leaf_specs(tree, axis_name) -> list:
    """For each leaf of `tree` (in order), the part of an explicit `axis_name` that describes
    it: None, a mesh axis name, a tuple of names or a `PartitionSpec`."""
    check_axis_name(axis_name)
    n = len(jax.tree.leaves(tree))
    if axis_name is None:
        return [None] * n
    if isinstance(axis_name, (str, PartitionSpec)) or (
        type(axis_name) is tuple and axis_name and all(isinstance(a, str) for a in axis_name)
    ):
        return [axis_name] * n

    def per_subtree(spec, subtree):
        return _LeafSpecs([spec] * len(jax.tree.leaves(subtree)))

    try:
        per_leaf = jax.tree.map(per_subtree, axis_name, tree, is_leaf=is_axis_spec)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`axis_name` must be a mesh axis name, a tuple of names, or a pytree of "
            "PartitionSpecs / names matching the updates (or a prefix of them, like "
            f"shard_map's `in_specs`); it does not match the updates: {error}"
        ) from None
    out = [spec for group in jax.tree.leaves(per_leaf) for spec in group.specs]
    if len(out) != n:
        raise ValueError(f"`axis_name` describes {len(out)} leaves but the updates have {n}.")
    return out


# ----------------------------------------------------------------------------------------------
# Checks.


def check_bound(names) -> None:
    """Every axis in `names` must be bound here; the error lists the axes that are."""
    for name in names:
        if _is_bound(name):
            continue
        bound = bound_axis_names()
        if bound:
            where = f"the mesh axes bound here are {', '.join(repr(a) for a in bound)}"
        else:
            where = (
                "no mesh axis is bound here (`axis_name` is for code inside `jax.shard_map` "
                "or `jax.pmap`; under `jax.jit` with sharded arrays leave it None)"
            )
        raise ValueError(f"`axis_name` names mesh axis {name!r}, which is not bound: {where}.")


def _size(axes) -> int:
    return math.prod(lax.axis_size(a) for a in axes)


def check_declared(path, leaf, declared: tuple, what: str) -> None:
    """Inside `shard_map` with variation tracking: `declared` must be the axes `leaf` varies
    over (a leaf's declared split must match what JAX knows of it)."""
    varying = varying_axes(leaf)
    extra = tuple(a for a in declared if a not in varying)
    if extra:
        raise AxisNameError(
            f"`axis_name` declares leaf `{_checks.leaf_name(path)}` split over "
            f"{', '.join(repr(a) for a in extra)}, but it does not vary over "
            f"{'that axis' if len(extra) == 1 else 'those axes'}: it is replicated there, and "
            f"{what} would count it {_size(extra)} times. Declare only the axes it is split "
            "over (None or P() for a replicated leaf), or pass `axis_name=None` to read them "
            "from the leaf."
        )
    missing = tuple(sorted(varying - set(declared)))
    if missing:
        raise AxisNameError(
            f"Leaf `{_checks.leaf_name(path)}` varies over mesh "
            f"{'axis' if len(missing) == 1 else 'axes'} {', '.join(repr(a) for a in missing)}, "
            "which `axis_name` does not declare for it: each device would clip by the norm of "
            "its own piece. Declare every axis the leaf is split over, or pass "
            "`axis_name=None` to read them from the leaf."
        )


def leaf_axes(tree, axis_name, what: str) -> list[tuple]:
    """For each leaf of `tree` (in order), the sorted mesh axes its partial sums are all-reduced
    over, from `axis_name` (checked) or, for None / ``"auto"``, from JAX's tracking."""
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    tracked = tracks_variation()
    if is_auto(axis_name):
        if not tracked:
            if axis_name is not None and bound_axis_names():
                raise ValueError(
                    "`axis_name='auto'` reads each leaf's mesh axes from JAX's tracking of how "
                    "values vary over them, which exists only inside `jax.shard_map` with "
                    "`check_vma=True` (the default); here (under `pmap`, or `check_vma=False`) "
                    "name the axes: a name, a tuple of names, or shard_map's `in_specs`."
                )
            return [()] * len(paths_and_leaves)
        return [tuple(sorted(varying_axes(leaf))) for _, leaf in paths_and_leaves]
    axes = [spec_axes(spec) for spec in leaf_specs(tree, axis_name)]
    check_bound(sorted({a for leaf in axes for a in leaf}))
    if tracked:
        for (path, leaf), declared in zip(paths_and_leaves, axes):
            check_declared(path, leaf, declared, what)
    return axes


# ----------------------------------------------------------------------------------------------
# The run-time check: are the leaves declared split really different on every device?


def _fingerprint(x):
    """Two numbers that differ between two different arrays of one shape (but by a
    coincidence of float sums): ``sum |x|`` (0 only for zeros) and a sum weighted by a hash of
    each element's position (so a permutation differs)."""
    x = jnp.asarray(x)
    parts = _reductions.real_parts(x) if jnp.issubdtype(x.dtype, jnp.inexact) else (x,)
    acc = _reductions.accum_dtype(x.dtype)
    v = jnp.concatenate([jnp.ravel(part).astype(acc) for part in parts])
    index = lax.iota(jnp.uint32, v.size)
    weight = ((index * jnp.uint32(2654435761)) >> jnp.uint32(8)).astype(acc) * acc.type(2**-24)
    return jnp.stack([jnp.sum(jnp.abs(v)), jnp.sum(v * weight)]).astype(jnp.float32)


def _replicated_report(names: list, pairs: list):
    """The host side of `check_split`: raises `AxisNameError` for the flagged (leaf, axis)
    pairs, through `_errors` (so that `reraise_errors` gives it back as itself)."""

    def report(flags):
        flags = np.asarray(flags).reshape(-1, len(pairs)).any(axis=0)  # (batched: any)
        if not flags.any():
            return  # (a batched `cond` runs this branch for every example)
        flagged = [pair for pair, flag in zip(pairs, flags) if flag]
        leaves = ", ".join(f"`{names[i]}` over {axis!r}" for i, axis in flagged)
        _errors.raise_from_callback(
            AxisNameError(
                f"`axis_name` declares leaves split over mesh axes on which they are the same "
                f"on every device: {leaves}. Such a leaf is replicated there (say, after "
                "`lax.pmean`), and a norm would count it once per device (sqrt(n) times too "
                "large over n devices). Declare it replicated: None for it in an `axis_name` "
                "pytree, or `axis_name=None` if every leaf is."
            )
        )

    return report


def check_split(tree, axis_name) -> None:
    r"""Checks, when the step runs, that the leaves `axis_name` declares split over mesh axes
    differ between the devices: one declared split that is the same on every device is
    replicated, and a norm would count it once per device.

    Under ``pmap`` (and ``shard_map(check_vma=False)``) JAX does not track which axes a value
    varies over, so ``axis_name`` is taken on trust: gradients averaged with ``lax.pmean``
    (the same on every device) but declared split (``axis_name="i"``) get a global norm
    :math:`\sqrt{n}` times too large over :math:`n` devices, and the clip is that much too
    strong, silently. Call this once on the gradients and the same `axis_name`, inside the
    ``pmap``, while setting the step up (or keep it: it costs two small all-reduces per axis).

    Each leaf declared split over an axis (of more than one device) is reduced to a
    fingerprint (the sum of its magnitudes and a position-weighted sum), whose largest and
    smallest value over the axis are compared: equal and nonzero means the same on every
    device. A leaf that is zero everywhere is never reported (counting zeros is harmless).
    Inside ``shard_map`` with ``check_vma=True`` (its default) the same mistake is caught when
    the step is traced, from JAX's tracking, and nothing runs.

    Args:
      tree: the gradients (or updates), as the clip will see them.
      axis_name: what you pass the clip: a mesh axis name, a tuple of names, or a pytree of
        ``PartitionSpec`` s / names (``None`` or ``P()`` for a replicated leaf).

    Returns:
      None. Under a transformation, a ``lax.cond`` on the comparison runs a host callback
      that raises only when a leaf is found replicated; use :func:`reraise_errors` around the
      step to receive it as :class:`AxisNameError`.

    Raises:
      AxisNameError: a leaf declared split over an axis is the same on every device of it.
      ValueError: an axis of `axis_name` is not bound here, or it does not match `tree`.
      TypeError: `axis_name` is not one of the accepted forms; a non-numeric leaf (a str, a
        NumPy array of objects), named by its path.

    Examples:
      >>> import jax, jax.numpy as jnp, optclip
      >>> def step(grads):
      ...     grads = jax.lax.pmean(grads, "i")       # now the same on every device
      ...     optclip.check_split(grads, "i")          # but declared split over "i"
      ...     return optclip.global_norm(grads, axis_name="i")
      >>> grads = jnp.arange(8.0).reshape(4, 2)      # 4 "devices" (a named vmap here)
      >>> try:
      ...     with optclip.reraise_errors():  # (one program, awaited: where a GPU reports it)
      ...         _ = jax.block_until_ready(jax.jit(jax.vmap(step, axis_name="i"))(grads))
      ... except optclip.AxisNameError as error:
      ...     print(str(error)[:76])
      `axis_name` declares leaves split over mesh axes on which they are the same
    """
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in paths_and_leaves:
        _checks.check_array_leaf(path, leaf, "`check_split`")
    declared = leaf_axes(tree, axis_name, "a norm")  # bound, and the tracked split if known
    if tracks_variation():
        return  # inside shard_map the checks above were exact
    pairs, flags = [], []
    for axis in sorted({a for axes in declared for a in axes}):
        if lax.axis_size(axis) == 1:
            continue
        split = [i for i, axes in enumerate(declared) if axis in axes]
        prints = jnp.stack([_fingerprint(paths_and_leaves[i][1]) for i in split])
        same = jnp.all(lax.pmax(prints, axis) == lax.pmin(prints, axis), axis=1)
        flags.append(same & (prints[:, 0] > 0) & jnp.all(jnp.isfinite(prints), axis=1))
        pairs += [(i, axis) for i in split]
    if not pairs:
        return
    flagged = jnp.concatenate(flags)
    names = [_checks.leaf_name(path) for path, _ in paths_and_leaves]
    report = _replicated_report(names, pairs)
    lax.cond(jnp.any(flagged), lambda: jax.debug.callback(report, flagged), lambda: None)
