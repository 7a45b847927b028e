"""Per-group norms: which leaves form a group, and the state field that keeps their norms.

A clip with ``group_norms=...`` stores, next to the global norm, the pre-clip norm of each group
of leaves (per layer, per block, per leaf). The groups are fixed by the tree's structure when the
state is made, so the field has a fixed shape; the norms come from the partial sums the global
norm computes anyway (`_norms.tree_norms`' buckets), not from a second pass over the gradients.

Stacked layers (``stacked=``, `_layers`) are seen layer by layer: layer ``i`` of the leaf at
``blocks/attn/w`` is named as if the model were unrolled, ``blocks/i/attn/w``, and every group
spec applies to these names.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import GetAttrKey

from optclip import _checks
from optclip.norms import _layers
from optclip.norms._layers import check_stacked as check_stacked
from optclip.norms._layers import is_variable as is_variable
from optclip.norms._layers import key_text as key_text
from optclip.norms._layers import path_name as path_name

ACCEPTED = (
    '`group_norms` must be None, "leaf" (one group per leaf), "layer" (one group per layer of '
    "the `stacked` leaves, every other leaf its own group), an int >= 1 (the leaves under each "
    "key path of that depth form a group: 1 groups by top-level key), or a function of a leaf's "
    "key path that returns its group's name (a str) or None (in no group)"
)


@jax.tree_util.register_pytree_with_keys_class
class GroupNorms:
    """The pre-clip norms of groups of leaves, readable by name.

    A pytree whose one leaf is `values` (shape ``(len(names),)``); the names (and `layers`, the
    number of layers of each stack of ``stacked=``) are static, so the structure never changes
    between steps and it checkpoints like any array.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> norms = optclip.GroupNorms(("encoder", "decoder"), jnp.array([3.0, 4.0]))
      >>> print(norms["decoder"], list(norms))
      4.0 ['encoder', 'decoder']
    """

    __slots__ = ("names", "values", "layers")

    def __init__(self, names, values, layers=()):
        self.names = tuple(names)
        self.values = values
        self.layers = tuple(layers)  # ((stack's key path, number of layers), ...)

    def __getitem__(self, name: str):
        try:
            index = self.names.index(name)
        except ValueError:
            listed = ", ".join(repr(n) for n in self.names[:20])
            more = f" and {len(self.names) - 20} more" if len(self.names) > 20 else ""
            raise KeyError(f"No group named {name!r}; the groups are {listed}{more}.") from None
        return self.values[index]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def keys(self):
        return self.names

    def items(self):
        return [(name, self.values[i]) for i, name in enumerate(self.names)]

    def __repr__(self) -> str:
        layers = f", layers={self.layers!r}" if self.layers else ""
        return f"GroupNorms(names={self.names!r}, values={self.values!r}{layers})"

    def tree_flatten_with_keys(self):
        return ((GetAttrKey("values"), self.values),), (self.names, self.layers)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(aux[0], children[0], aux[1])


def check_spec(spec):
    """`group_norms` as given to a factory: None, "leaf", "layer", an int >= 1, or a callable."""
    if isinstance(spec, jax.Array):
        raise TypeError(
            "`group_norms` decides the shape of the state and must be static, got a JAX array "
            "(with `optax.inject_hyperparams`, pass `static_args=('group_norms',)`)."
        )
    if spec is None or callable(spec) or (isinstance(spec, str) and spec in ("leaf", "layer")):
        return spec
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool) and int(spec) >= 1:
        return int(spec)
    raise ValueError(f"{ACCEPTED}; got {spec!r}.")


# ----------------------------------------------------------------------------------------------
# Groups.


def _group_of(spec, path, skip: int, stack) -> str | None:
    if spec == "leaf":
        return path_name(path)
    if spec == "layer":
        return path_name(path[: stack.prefix + 1] if stack else path)
    if isinstance(spec, int):
        return path_name(path[: skip + spec])
    name = spec(path)
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"The `group_norms` function must return a group name (a str) or None; for leaf "
            f"`{_checks.leaf_name(path)}` it returned {name!r}."
        )
    return name


def _unrolled(flat, leaf_stacks, layers) -> list:
    """``(leaf, layer)`` pairs (layer None for a leaf not stacked) in the order of the leaves of
    the unrolled model: a stack's leaves for layer 0, then for layer 1, ..."""
    order: list[tuple[int, int | None]] = []
    done: set[tuple] = set()
    for i, ((path, _), stack) in enumerate(zip(flat, leaf_stacks)):
        if stack is None:
            order.append((i, None))
            continue
        key = tuple(path[: stack.prefix])
        if key in done:
            continue
        done.add(key)
        members = [
            m
            for m, ((p, _), s) in enumerate(zip(flat, leaf_stacks))
            if s is not None and tuple(p[: s.prefix]) == key
        ]
        order.extend((m, layer) for layer in range(layers[i]) for m in members)
    return order


def assign(spec, tree, stacked: tuple = (), layers=None) -> tuple[tuple, tuple]:
    """``(names, buckets)``: the groups of `tree`'s leaves in the order of the unrolled model's
    leaves, and each leaf's bucket for `_norms.tree_norms` (its group's index; a tuple of one per
    layer for a stacked leaf; leaves in no group share one more bucket after the groups).
    `layers`: each leaf's number of layers (default: from its shape)."""
    flat = _layers.leaves_with_paths(tree)
    leaf_stacks = _layers.stacks(stacked, tree)
    if layers is None:
        layers = [
            None if s is None else _layers.shape_of(x)[s.axis]
            for (_, x), s in zip(flat, leaf_stacks)
        ]
    skip = _layers.flax_root([path for path, _ in flat])
    group: dict = {}
    for i, layer in _unrolled(flat, leaf_stacks, layers):
        stack, path = leaf_stacks[i], flat[i][0]
        group[i, layer] = _group_of(
            spec, path if stack is None else _layers.expanded(path, stack, layer), skip, stack
        )
    names: dict = {}
    for name in group.values():
        if name is not None:
            names.setdefault(name, len(names))
    rest = len(names)

    def bucket(i, layer):
        name = group[i, layer]
        return rest if name is None else names[name]

    buckets = tuple(
        bucket(i, None) if s is None else tuple(bucket(i, layer) for layer in range(layers[i]))
        for i, s in enumerate(leaf_stacks)
    )
    return tuple(names), buckets


class Layout(NamedTuple):
    """How `_norms.tree_norms` collects the leaves' partial sums."""

    buckets: tuple  # per leaf: its bucket, or one per layer (stacked); () without groups
    layer_axes: tuple  # per leaf: its layer axis (one partial sum per layer), or None
    splits: tuple  # per leaf: the mesh axes that split its layer axis (major first), or ()


def _check_names(field, names, what: str) -> None:
    if names == field.names:
        return
    made, got = set(field.names), set(names)
    detail = (
        f"groups only in the state: {sorted(made - got)[:5]}; only in the updates: "
        f"{sorted(got - made)[:5]}"
        if made != got
        else "the same groups in another order"
    )
    raise ValueError(
        f"`{what}`'s `group_norms` state was made (by `init`) for other parameters than "
        f"these updates ({detail}). Call `init` with parameters shaped like the updates."
    )


def layout(spec, stacked: tuple, updates, field, what: str, axis_name=None) -> Layout | None:
    """How the norm of `updates` is reduced: per layer for stacked leaves, into the groups the
    state was made with (checked); None without groups or stacked leaves."""
    if spec is None and not stacked:
        return None
    _checks.check_leaves(updates, what)  # (before their shapes are read)
    leaf_stacks = _layers.stacks(stacked, updates)
    axes = tuple(None if s is None else s.axis for s in leaf_stacks)
    if spec is None:
        return Layout((), axes, ((),) * len(leaf_stacks))
    layers, splits = _layers.layer_splits(updates, leaf_stacks, axis_name, dict(field.layers), what)
    names, buckets = assign(spec, updates, stacked, layers)
    _check_names(field, names, what)
    return Layout(buckets, axes, splits)


def buckets(spec, updates, field, what: str) -> tuple:
    """Each update leaf's bucket (no stacked leaves), checked against the state's groups."""
    found = layout(spec, (), updates, field, what)
    return () if found is None else found.buckets


def init(spec, params, dtype, stacked: tuple = (), axis_name=None, what: str = "the clip"):
    """The state's `group_norms` field: None without groups, else zeros for each group of
    `params` (and the number of layers of each stack). `stacked` is checked against `params`
    with or without groups, as `layout` checks it against the updates."""
    leaf_stacks = _layers.stacks(stacked, params)
    if spec is None:
        return None
    layers, _ = _layers.layer_splits(params, leaf_stacks, axis_name, None, what)
    names, _ = assign(spec, params, stacked, layers)
    flat = _layers.leaves_with_paths(params)
    counts: dict = {}
    for (path, _), stack, count in zip(flat, leaf_stacks, layers):
        if stack is not None:
            counts.setdefault(path_name(path[: stack.prefix]), count)
    return GroupNorms(names, jnp.zeros((len(names),), dtype), tuple(counts.items()))


def update(field, bucket_norms):
    """The `group_norms` field after an update: the first ``len(field)`` bucket norms."""
    if field is None:
        return None
    values = bucket_norms[: len(field.names)].astype(np.dtype(field.values.dtype))
    return GroupNorms(field.names, values, field.layers)
