"""A *site*: one equation of the per-example loss with parameter views among its operands,
and how its use of the parameter is classified.

A site is

* `Kind.DENSE`: `dot_general` with one view reached through plain views (dtype conversions,
  transposes, slices and splits, the scans' slices, scalings): dense layers and einsums;
* `Kind.EMBED`: `gather` of whole rows of a 2-D view, outside scans: an embedding lookup;
* `Kind.CONV`: `conv_general_dilated` by one kernel view;
* `Kind.ADDED`: `add` or `sub` of a part of a leaf (``pos[:T]``, a `dynamic_slice` of
  learned positions) and an operand of its shape, outside scans: the part's gradient is the
  output gradient (its negation for a subtracted part), and nothing is recorded;
* `Kind.FALLBACK`: anything else (the leaf's per-example gradient is materialised).

A closed-form site's `Layout` names, in the leaf's dimensions, how its per-example gradient
is ``sum_k x_k (outer) y_k`` per head: the heads, the dimensions of the factor built from the
recorded operand (``x``) and of the factor built from the output gradient (``y``), and the
parts the use takes of the leaf's dimensions (single indices, or ranges: a part of a fused
weight). Uses of one leaf that take the same parts and share a layout (or its transpose) have
closed cross terms; uses of disjoint parts have none.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple


class Kind(enum.Enum):
    DENSE = "dense"
    EMBED = "embed"
    CONV = "conv"
    ADDED = "added"
    FALLBACK = "fallback"


class Layout(NamedTuple):
    """A closed-form use's per-example gradient in the leaf's dimensions (see the module)."""

    heads: tuple  # per enclosing scan the leaf dimension it slices (None: a constant), then
    # the operation's own heads (a `dot_general` batch dimension; a convolution's groups)
    inputs: tuple  # the leaf dimensions of the factor from the recorded operand
    outputs: tuple  # the leaf dimensions of the factor from the output gradient
    pins: tuple  # ((leaf dimension, (start, stop, stride)), ...): the parts the use takes

    def transposed(self) -> Layout:
        return Layout(self.heads, self.outputs, self.inputs, self.pins)


class Classified(NamedTuple):
    """What a rule says of an equation with parameter views: its kind, why, its layout."""

    kind: Kind
    reason: str
    layout: Layout | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """An equation that uses parameter views (`views`: ``(operand position, View)``), as
    classified (`kind`, `reason`, `layout`), inside scans of lengths `stack` (outermost
    first), its recorded operands keyed by `records` (sites that record one variable share
    its key)."""

    id: int
    eqn: Any
    views: tuple
    kind: Kind
    reason: str
    layout: Layout | None = None
    stack: tuple = ()
    records: tuple = ()

    @property
    def depth(self) -> int:
        """How many scans the site is inside."""
        return len(self.stack)

    @property
    def recorded(self) -> list[int]:
        """The operand positions the tapped pass records, in order: `recorded` of its kind."""
        return recorded(self.kind, self.eqn, self.views)


def recorded(kind: Kind, eqn, views) -> list[int]:
    """The operand positions a site of `kind` records: every one but the parameter `views`
    (``(position, View)``), none for an added part (its gradient does not read them)."""
    if kind is Kind.ADDED:
        return []
    viewed = {pos for pos, _ in views}
    return [i for i in range(len(eqn.invars)) if i not in viewed]


def fallback(eqn, why: str) -> Classified:
    return Classified(Kind.FALLBACK, f"`{eqn.primitive.name}` {why}")


ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul", "neg", "div"})


def other(eqn, used) -> Classified:
    """A site with no rule: elementwise (a bias or a scale) or with no closed form."""
    del used
    name = eqn.primitive.name
    if name in ELEMENTWISE:
        why = (
            f"elementwise `{name}` (a bias or a scale): per-example gradient of the "
            "parameter's size"
        )
        return Classified(Kind.FALLBACK, why)
    return Classified(Kind.FALLBACK, f"no closed form for `{name}`")


def added(eqn, used) -> Classified:
    """`add` or `sub` of one view, a part of its leaf outside scans, and an operand of the
    output's shape: learned positions sliced to the sequence (``x + pos[:T]``), dimensions of
    size 1 inserted or not (`_views.View.unit_dims_dropped`). Its layout has no input
    dimensions and the part's leaf dimensions, in the leaf's order, as outputs.
    A whole leaf added (a bias) stays a fallback: its per-example gradient is no larger than
    the output gradient a tap would hold."""
    view = used[0][1]
    plain = len(used) == 1 and not view.depth
    mapped = view.unit_dims_dropped()[0].leaf_dims() if plain else None
    shape = eqn.outvars[0].aval.shape
    same = all(v.aval.shape == shape for v in eqn.invars)
    if mapped is None or not mapped[2] or not same:
        return other(eqn, used)
    dims, _, pins = mapped
    layout = Layout((), (), tuple(sorted(dims)), pins)
    return Classified(Kind.ADDED, f"part added (`{eqn.primitive.name}`): ghost norm", layout)


def dense(eqn, used) -> Classified:
    """A `dot_general` of one plain view: its heads, contracted and free dimensions."""
    if len(used) != 1:
        return fallback(eqn, "of two parameter views")
    pos, view = used[0]
    ndim = len(eqn.invars[pos].aval.shape)
    mapped = view.leaf_dims()
    if mapped is None:
        return fallback(eqn, "of a reshaped or broadcast parameter")
    dims, levels, pins = mapped
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    contract = tuple(contract_l if pos == 0 else contract_r)
    batch = tuple(batch_l if pos == 0 else batch_r)
    free = tuple(d for d in range(ndim) if d not in contract + batch)
    heads = tuple(d for d in levels if d is not None) + tuple(dims[d] for d in batch)
    layout = Layout(heads, tuple(dims[d] for d in contract), tuple(dims[d] for d in free), pins)
    return Classified(Kind.DENSE, "dense (`dot_general`): ghost norm", layout)


def conv(eqn, used) -> Classified:
    """A convolution by a plain kernel view: ghost from the input's patches. The layout names
    the leaf's dimensions of the kernel's input features and window (the patches' features,
    in their order) and of its output features, the feature groups being heads."""
    pos, view = used[0]
    if len(used) != 1 or pos != 1:
        return fallback(eqn, "of a parameter as its input (not its kernel)")
    if eqn.params["batch_group_count"] != 1:
        return fallback(eqn, "with `batch_group_count` (no closed form written)")
    mapped = view.leaf_dims()
    if mapped is None:
        return fallback(eqn, "by a reshaped or broadcast kernel")
    dims, levels, pins = mapped
    rhs = eqn.params["dimension_numbers"].rhs_spec
    heads = (*(d for d in levels if d is not None), ("groups", eqn.params["feature_group_count"]))
    layout = Layout(heads, tuple(dims[d] for d in rhs[1:]), (dims[rhs[0]],), pins)
    return Classified(Kind.CONV, "convolution: ghost norm from patches", layout)


class Lookup(NamedTuple):
    """An embedding lookup: the table's `row` dimension, the positions in each index vector
    of the row's index and (where the index vector also names the other dimension, always
    starting at 0 since its slice is whole, as ``jax.vmap(lambda i: table[i])`` writes it) of
    the column's, else None, and the output's dimension of the row's `features`."""

    row: int
    row_index: int
    column_index: int | None
    features: int


def lookup(eqn, pos: int) -> Lookup | None:
    """How a `gather` of operand `pos` looks up whole rows of a 2-D table, one index per row
    (``table[ids]``, ``jnp.take(table, ids, axis=...)``, ``jax.vmap(lambda i: table[i])``,
    columns: ``table[:, ids]``), the row's features at any place in the output; else None."""
    numbers = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    indices = eqn.invars[1].aval.shape
    starts = tuple(numbers.start_index_map)
    if pos != 0 or len(shape) != 2 or numbers.operand_batching_dims or not indices:
        return None
    collapsed = tuple(numbers.collapsed_slice_dims)
    offsets = tuple(numbers.offset_dims)  # (the output's dimensions of the operand's kept ones)
    sizes = tuple(eqn.params["slice_sizes"])
    if len(collapsed) == 1:
        row = collapsed[0]
    elif not collapsed and 1 in sizes:
        # The row's slice dimension kept (size 1, squeezed afterwards): ``vmap(lambda i:
        # table[i])`` keeps the first; penzai's named-axis lookup, on the transposed table, the
        # second.
        row = sizes.index(1)
    else:
        return None
    full = tuple(1 if d == row else shape[d] for d in range(2))
    if (
        sizes != full
        or row not in starts
        or not set(starts) <= {0, 1}
        or indices[-1] != len(starts)
        or len(offsets) != 2 - len(collapsed)
    ):
        return None
    column = starts.index(1 - row) if 1 - row in starts else None
    features = offsets[-1] if collapsed else offsets[1 - row]  # (offsets: in operand order)
    return Lookup(row, starts.index(row), column, features)


def embed(eqn, used) -> Classified:
    """A `gather` of whole rows of a 2-D view outside scans (`lookup`)."""
    pos, view = used[0]
    found = lookup(eqn, pos) if len(used) == 1 and not view.depth else None
    mapped = view.leaf_dims() if found is not None else None
    if found is None or mapped is None or len(mapped[0]) != 2:
        return fallback(eqn, "is not a lookup of whole rows of a parameter outside a scan")
    dims, _, pins = mapped
    layout = Layout((), (dims[found.row],), (dims[1 - found.row],), pins)
    return Classified(Kind.EMBED, "embedding lookup (`gather`): ghost norm", layout)
