"""The operations the ghost engine knows, one rule each, keyed by primitive (as JAX's own jaxpr
interpreters dispatch): how an equation that uses a parameter view is classified (`_sites`),
the factors of its per-example gradient (`_factors`), and its clipped sum over the batch where
it is written out (`_products`; None: JAX's VJP of the batched equation). An equation whose
primitive has no rule is a fallback site (`_sites.other`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from optclip.per_example.ghost import _convs, _factors, _products, _sites


class Rule(NamedTuple):
    classify: Callable  # (eqn, used) -> _sites.Classified
    factors: Callable  # (site, record, output gradient, acc) -> (x, y): `_factors.Factor`s
    # (site, stacked view, record, cotangent, target, depth) -> cotangent, or None
    view_sum: Callable | None


RULES: dict[str, Rule] = {
    "dot_general": Rule(_sites.dense, _factors.dense_factors, _products.dense_view_sum),
    "gather": Rule(_sites.embed, _factors.embed_factors, None),
    "conv_general_dilated": Rule(_sites.conv, _convs.conv_factors, _products.conv_view_sum),
    "add": Rule(_sites.added, _factors.added_factors, None),
    "add_any": Rule(_sites.added, _factors.added_factors, None),
    "sub": Rule(_sites.added, _factors.added_factors, None),
}


def classify(eqn, used) -> _sites.Classified:
    """What `eqn`, with the parameter views `used` (``(operand position, View)``) among its
    operands, is: by its primitive's rule, else a fallback (`_sites.other`)."""
    rule = RULES.get(eqn.primitive.name)
    return (_sites.other if rule is None else rule.classify)(eqn, used)


def of(site) -> Rule:
    """The rule of a closed-form site."""
    return RULES[site.eqn.primitive.name]
