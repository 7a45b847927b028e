"""Key paths and stacked layers: which leaves hold a stack of layers, along which axis, and how
the mesh splits it.

JAX models usually keep the blocks of a scanned model (`nn.scan`, `nnx.vmap`, MaxText, Levanter)
in one leaf per weight with a leading (or other) layer axis. ``stacked=`` names the subtrees that
hold such leaves; each of their leaves is then reduced over all axes but the layer axis (one
partial sum per layer), and layer ``i`` of the leaf at ``blocks/attn/w`` is named as if the model
were unrolled, ``blocks/i/attn/w`` (`_groups` names the groups from these paths).

Inside `shard_map`/`pmap` a device may hold only some layers of a leaf (pipeline-style): the mesh
axes that split the layer axis come from `axis_name`'s `PartitionSpec`s, or are inferred from the
number of layers the state was made for.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from optclip.norms import _axes

STACKED_ACCEPTED = (
    '`stacked` must be None, the key path of a subtree of stacked layers ("blocks", '
    '"decoder/layers": layer axis 0), a list of key paths, or a dict from key paths to their '
    'layer axis ({"decoder/layers": 1})'
)
FLAX_ROOT = "params"  # a Flax variables dict {"params": ...}: depths count the keys under it


def is_variable(x) -> bool:
    """A Flax NNX Variable (`Param`, `OptArray`) or the like: an object holding an array as its
    `value`. Its key path ends at it (`dense/kernel`, not `dense/kernel/value`), so the groups
    of the parameters given to `init` and of the gradients given to `update` have one name."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number)) or x is None:
        return False
    wraps = callable(getattr(x, "get_value", None)) or hasattr(x, "value")
    return wraps and len(jax.tree.leaves(x)) == 1


def key_text(key) -> str:
    """One key of a key path as plain text: a dict key, an index or an attribute name."""
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def path_name(path) -> str:
    """A key path as a group name: its keys joined by "/" (``"encoder/layers/0/kernel"``)."""
    return "/".join(key_text(k) for k in path) or "<array>"


def check_stacked(stacked, spec=None) -> tuple:
    """`stacked` as given to a factory, as ``((keys of a key path, layer axis), ...)``."""
    if stacked is None:
        if isinstance(spec, str) and spec == "layer":
            raise ValueError(
                '`group_norms="layer"` makes one group per layer of stacked leaves: say which '
                'leaves are stacked with `stacked=` (e.g. `stacked="blocks"`).'
            )
        return ()
    if isinstance(stacked, str):
        items = [(stacked, 0)]
    elif isinstance(stacked, Mapping):
        items = list(stacked.items())
    elif isinstance(stacked, (list, tuple)):
        items = [(path, 0) for path in stacked]
    else:
        raise TypeError(f"{STACKED_ACCEPTED}; got {stacked!r}.")
    out: list[tuple] = []
    for path, axis in items:
        keys = tuple(k for k in path.split("/") if k) if isinstance(path, str) else ()
        if not keys:
            raise ValueError(f"{STACKED_ACCEPTED}; got the key path {path!r} in {stacked!r}.")
        if not isinstance(axis, (numbers.Integral, np.integer)) or isinstance(axis, bool):
            raise TypeError(f"`stacked`'s layer axis for {path!r} must be an int, got {axis!r}.")
        out.append((keys, int(axis)))
    if not out:
        raise ValueError(f"{STACKED_ACCEPTED}; got an empty {type(stacked).__name__}.")
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Stacked leaves: which, along which axis, and how many layers.


class Stack(NamedTuple):
    """A leaf holding a stack of layers: its layer axis, and how many keys of its path name the
    stack (``blocks`` of ``blocks/attn/w``); layer ``i`` is named with ``i`` after them."""

    axis: int
    prefix: int


def leaves_with_paths(tree) -> list:
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]


def shape_of(leaf) -> tuple:
    return tuple(np.shape(jax.tree.leaves(leaf)[0]))


def flax_root(paths) -> int:
    """1 if the tree is a Flax variables dict holding only ``"params"``, else 0: the keys of a
    path that integer depths and `stacked` key paths may skip."""
    return int(
        bool(paths)
        and all(p and isinstance(p[0], DictKey) and p[0].key == FLAX_ROOT for p in paths)
    )


def _stack_of(path, declared, skip: int):
    """The declared stack a leaf's path lies in, as ``(index in declared, prefix, axis)``."""
    texts = tuple(key_text(k) for k in path)
    found = [
        (j, start + len(keys), axis)
        for j, (keys, axis) in enumerate(declared)
        for start in sorted({0, skip})
        if texts[start : start + len(keys)] == keys
    ]
    if len({j for j, _, _ in found}) > 1:
        names = " and ".join(repr("/".join(declared[j][0])) for j, _, _ in found)
        raise ValueError(f"Leaf `{path_name(path)}` is in two stacks of `stacked`: {names}.")
    return found[0] if found else None


def stacks(declared: tuple, tree) -> list:
    """Each leaf's `Stack`, or None for a leaf that is not stacked; checked: every declared key
    path holds leaves, each with the layer axis, and one number of layers per stack."""
    flat = leaves_with_paths(tree)
    skip = flax_root([path for path, _ in flat])
    out: list[Stack | None] = []
    used: set[int] = set()
    counts: dict[str, tuple] = {}
    for path, leaf in flat:
        found = _stack_of(path, declared, skip) if declared else None
        if found is None:
            out.append(None)
            continue
        j, prefix, axis = found
        used.add(j)
        shape = shape_of(leaf)
        if not -len(shape) <= axis < len(shape):
            raise ValueError(
                f"`stacked` gives leaf `{path_name(path)}` (shape {shape}) layer axis {axis}, "
                f"which it does not have."
            )
        stack = Stack(axis % len(shape), prefix)
        name = path_name(path[:prefix])
        first = counts.setdefault(name, (shape[stack.axis], path))
        if first[0] != shape[stack.axis]:
            raise ValueError(
                f"The leaves of stack {name!r} of `stacked` must hold one number of layers: "
                f"`{path_name(first[1])}` has {first[0]}, `{path_name(path)}` "
                f"{shape[stack.axis]}."
            )
        out.append(stack)
    for j, (keys, _) in enumerate(declared):
        if j not in used:
            top = sorted({key_text(p[skip]) for p, _ in flat if len(p) > skip})[:10]
            raise ValueError(
                f"`stacked` names {'/'.join(keys)!r}, which is no key path of this tree's "
                f"leaves (its top-level keys: {top})."
            )
    return out


def expanded(path, stack: Stack, layer: int) -> tuple:
    """Layer `layer`'s path: the stack's keys, the index, the rest (``blocks/3/attn/w``)."""
    return (*path[: stack.prefix], SequenceKey(layer), *path[stack.prefix :])


# ----------------------------------------------------------------------------------------------
# Stacks split over devices, and what `tree_norms` is given.


def _entry_axes(spec: PartitionSpec, dim: int) -> tuple:
    """The mesh axes a `PartitionSpec` splits dimension `dim` over, major first."""
    entry = spec[dim] if dim < len(spec) else None
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry) if isinstance(entry, tuple) else ()


def _infer_split(path, leaf, spec, count: int, want: int, what: str) -> tuple:
    """The one mesh axis that splits a stacked leaf's `want` layers into pieces of `count`,
    among the axes the leaf is split over (`axis_name`'s names, or JAX's tracking)."""
    array = jax.tree.leaves(leaf)[0]
    if _axes.is_auto(spec):
        candidates = _axes.varying_axes(array) if _axes.tracks_variation() else frozenset()
    else:
        candidates = frozenset(_axes.spec_axes(spec))
    fits = [a for a in sorted(candidates) if lax.axis_size(a) * count == want]
    if len(fits) == 1:
        return (fits[0],)
    raise ValueError(
        f"`{what}`: stacked leaf `{path_name(path)}` holds {count} of its {want} layers here "
        f"(its group norms were made by `init` for {want}), so its layer axis is split over "
        f"mesh axes, but which ones cannot be told from the axes it is split over "
        f"({sorted(candidates)}). Pass shard_map's `in_specs` for the updates as `axis_name`."
    )


def layer_splits(tree, leaf_stacks, axis_name, expected, what: str):
    """Each stacked leaf's number of layers in the whole model and the mesh axes that split its
    layer axis (inside shard_map/pmap a device may hold only some layers): from `axis_name`'s
    `PartitionSpec`s, or inferred from the layers the state was made for (`expected`; None at
    `init`, where a leaf that may be split is an error)."""
    flat = leaves_with_paths(tree)
    local = [None if s is None else shape_of(x)[s.axis] for (_, x), s in zip(flat, leaf_stacks)]
    if not any(leaf_stacks) or not _axes.bound_axis_names():
        return local, ((),) * len(flat)
    auto = _axes.is_auto(axis_name)
    specs = [axis_name] * len(flat) if auto else _axes.leaf_specs(tree, axis_name)
    layers, splits = [], []
    for (path, leaf), stack, count, spec in zip(flat, leaf_stacks, local, specs):
        split: tuple = ()
        if stack is not None and isinstance(spec, PartitionSpec):
            split = _entry_axes(spec, stack.axis)
            _axes.check_bound(split)
            if expected is None and _axes.tracks_variation():  # `init`: a constant is whole
                varying = _axes.varying_axes(jax.tree.leaves(leaf)[0])
                split = tuple(a for a in split if a in varying)
        elif stack is not None and expected is None:
            varying = _axes.varying_axes(jax.tree.leaves(leaf)[0])
            if _axes.tracks_variation() and varying:
                raise ValueError(
                    f"`{what}`'s `init` runs inside shard_map on each device's piece of stacked "
                    f"leaf `{path_name(path)}`, which varies over mesh axes {sorted(varying)}: "
                    "whether its layers are split is unknown. Call `init` on the global "
                    "parameters (outside shard_map), or pass shard_map's `in_specs` as "
                    "`axis_name`."
                )
        elif stack is not None and count is not None:
            want = expected.get(path_name(path[: stack.prefix]), count)
            if want != count and want % count == 0:
                split = _infer_split(path, leaf, spec, count, want, what)
        layers.append(None if count is None else count * math.prod(map(lax.axis_size, split)))
        splits.append(split)
    return layers, tuple(splits)


def bucket_ids(bucket, layers: int, split: tuple):
    """The buckets of a leaf's `layers` partial sums on this device, from its bucket (an int) or
    its buckets per layer of the whole model: static, or traced where the device holds only some
    layers (those from its index along the `split` mesh axes on)."""
    table = np.atleast_1d(np.asarray(bucket, np.int32))
    if np.all(table == table[0]):
        return np.full((layers,), table[0], np.int32)
    if not split:
        return table
    start = lax.axis_index(split) * layers
    return lax.dynamic_slice(jnp.asarray(table), (start,), (layers,))
