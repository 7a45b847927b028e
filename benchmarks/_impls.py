"""The two sides of every comparison: optclip and the optax it replaces.

``optax_side()`` is what users have today. ``optclip_side()`` is the library under test;
``--impl optax`` on the command line puts optax on both sides (a stand-in that checks the
harness itself: every ratio should then be close to 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax


@dataclasses.dataclass(frozen=True)
class Side:
    name: str
    global_norm: Callable[[Any], Any]
    global_clip: Callable[[float], optax.GradientTransformation]
    # Per-example clipping of a list of arrays with a leading batch axis, clipped and summed:
    # ``fn(grads, max_norm)`` returns ``(summed, num_clipped)`` on both sides (optclip's are
    # drop-ins for optax's).
    per_example_clip: Callable[[Any, float], Any]
    per_example_layer_clip: Callable[[Any, float], Any]


def optax_side() -> Side:
    return Side(
        "optax",
        optax.tree.norm,
        optax.clip_by_global_norm,
        optax.per_example_global_norm_clip,
        optax.per_example_layer_norm_clip,
    )


def optclip_side() -> Side:
    import optclip

    return Side(
        "optclip",
        optclip.global_norm,
        optclip.global_clip,
        optclip.per_example_clip,
        optclip.per_example_layer_clip,
    )


def resolve(name: str) -> Side:
    if name == "optclip":
        return optclip_side()
    if name == "optax":
        return optax_side()
    raise ValueError(f"`--impl` must be 'optclip' or 'optax', got {name!r}.")
