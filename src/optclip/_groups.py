"""Per-group norms: which leaves form a group, and the state field that keeps their norms.

A clip with ``group_norms=...`` stores, next to the global norm, the pre-clip norm of each group
of leaves (per layer, per block, per leaf). The groups are fixed by the tree's structure when the
state is made, so the field has a fixed shape; the norms come from the partial sums the global
norm computes anyway (`_norms.tree_norms`' buckets), not from a second pass over the gradients.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from optclip import _checks

ACCEPTED = (
    '`group_norms` must be None, "leaf" (one group per leaf), an int >= 1 (the leaves under each '
    "key path of that depth form a group: 1 groups by top-level key), or a function of a leaf's "
    "key path that returns its group's name (a str) or None (in no group)"
)


@jax.tree_util.register_pytree_with_keys_class
class GroupNorms:
    """The pre-clip norms of groups of leaves, readable by name.

    A pytree whose one leaf is `values` (shape ``(len(names),)``); the names are static, so the
    structure never changes between steps and it checkpoints like any array.

    Examples:
      >>> import jax.numpy as jnp, optclip
      >>> norms = optclip.GroupNorms(("encoder", "decoder"), jnp.array([3.0, 4.0]))
      >>> print(norms["decoder"], list(norms))
      4.0 ['encoder', 'decoder']
    """

    __slots__ = ("names", "values")

    def __init__(self, names, values):
        self.names = tuple(names)
        self.values = values

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
        return f"GroupNorms(names={self.names!r}, values={self.values!r})"

    def tree_flatten_with_keys(self):
        return ((GetAttrKey("values"), self.values),), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, children[0])


def is_variable(x) -> bool:
    """A Flax NNX Variable (`Param`, `OptArray`) or the like: an object holding an array as its
    `value`. Its key path ends at it (`dense/kernel`, not `dense/kernel/value`), so the groups
    of the parameters given to `init` and of the gradients given to `update` have one name."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number)) or x is None:
        return False
    wraps = callable(getattr(x, "get_value", None)) or hasattr(x, "value")
    return wraps and len(jax.tree.leaves(x)) == 1


def check_spec(spec):
    """`group_norms` as given to a factory: None, "leaf", an int >= 1, or a callable."""
    if isinstance(spec, jax.Array):
        raise TypeError(
            "`group_norms` decides the shape of the state and must be static, got a JAX array "
            "(with `optax.inject_hyperparams`, pass `static_args=('group_norms',)`)."
        )
    if spec is None or callable(spec) or (isinstance(spec, str) and spec == "leaf"):
        return spec
    if isinstance(spec, numbers.Integral) and not isinstance(spec, bool) and int(spec) >= 1:
        return int(spec)
    raise ValueError(f"{ACCEPTED}; got {spec!r}.")


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


def _group_of(spec, path) -> str | None:
    if spec == "leaf":
        return path_name(path)
    if isinstance(spec, int):
        return path_name(path[:spec])
    name = spec(path)
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"The `group_norms` function must return a group name (a str) or None; for leaf "
            f"`{_checks.leaf_name(path)}` it returned {name!r}."
        )
    return name


def assign(spec: str | int | Callable, tree) -> tuple[tuple, tuple]:
    """``(names, buckets)``: the groups of `tree`'s leaves in order of first appearance, and
    each leaf's bucket for `_norms.tree_norms` (its group's index; leaves in no group share one
    more bucket after the groups)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_variable)[0]
    paths = [path for path, _ in flat]
    names: dict = {}
    groups = [_group_of(spec, path) for path in paths]
    for name in groups:
        if name is not None:
            names.setdefault(name, len(names))
    rest = len(names)
    return tuple(names), tuple(rest if name is None else names[name] for name in groups)


def init(spec, params, dtype):
    """The state's `group_norms` field: None without groups, else zeros for each group of
    `params`."""
    if spec is None:
        return None
    names, _ = assign(spec, params)
    return GroupNorms(names, jnp.zeros((len(names),), dtype))


def buckets(spec, updates, field, what: str) -> tuple:
    """Each update leaf's bucket, checked against the groups the state was made with."""
    if spec is None:
        return ()
    names, leaf_buckets = assign(spec, updates)
    if names != field.names:
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
    return leaf_buckets


def update(field, bucket_norms):
    """The `group_norms` field after an update: the first ``len(field)`` bucket norms."""
    if field is None:
        return None
    values = bucket_norms[: len(field.names)].astype(np.dtype(field.values.dtype))
    return GroupNorms(field.names, values)
