"""`optclip.metrics`: every optclip state inside an optimizer state, as one flat dict."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import optax
from jax.tree_util import GetAttrKey

from optclip import _checks
from optclip.adaptive._adagc import AdaGCState
from optclip.adaptive._agc import AGCState
from optclip.adaptive._autoclip import AutoClipState
from optclip.adaptive._zclip import ZClipState
from optclip.clips._clipped import ClippedState
from optclip.clips._transforms import GlobalClipState
from optclip.guards._guarded import GuardedState
from optclip.guards._loss_scale import LossScaleState
from optclip.guards._spikes import SpikeState
from optclip.norms._groups import is_variable, key_text

KINDS = {
    GlobalClipState: "global_clip",
    AutoClipState: "autoclip",
    ZClipState: "zclip",
    AGCState: "agc",
    AdaGCState: "adagc",
    ClippedState: "clipped",
    GuardedState: "guarded",
    LossScaleState: "loss_scale",
    SpikeState: "skip_spikes",
}
_STATES = tuple(KINDS)
# Wrappers' fields that hold other states (searched too), and their own loggable fields.
_NESTED = {
    ClippedState: ("clip_state", "inner_state"),
    GuardedState: ("clip_state", "inner_state", "scaler", "spikes"),
}
_OWN_FIELDS = {
    ClippedState: ("skip_count",),
    GuardedState: (
        "global_norm",
        "skipped",
        "skip_count",
        "nonfinite_count",
        "nonfinite_streak",
        "step",
    ),
    LossScaleState: ("loss_scale", "growth_tracker", "overflow_count"),
    SpikeState: ("norm_threshold", "loss_threshold", "spike_count", "filled"),
}


def _is_state(x) -> bool:
    return isinstance(x, _STATES)


def _find(tree, path=()) -> list:
    """``(key path, state)`` of every optclip state in `tree`, in tree order."""
    found = []
    for sub, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)[0]:
        if not _is_state(node):
            continue
        found.append((path + sub, node))
        for field in _NESTED.get(type(node), ()):
            found += _find(getattr(node, field), path + sub + (GetAttrKey(field),))
    return found


def _unwrap(x):
    getter = getattr(x, "get_value", None)
    return getter() if callable(getter) else x.value


def _plain(state):
    """`state` with its fields as arrays: Flax NNX keeps them in Variables whose value the next
    update replaces in place, so logging the Variable itself logs the last step every time."""
    return jax.tree.map(lambda x: _unwrap(x) if is_variable(x) else x, state, is_leaf=is_variable)


def _fields(state) -> list:
    """The loggable fields of one state (derived ones included), as ``(name, value thunk)``:
    the names are known without computing anything."""
    if type(state) in _OWN_FIELDS:
        own = _OWN_FIELDS[type(state)]
        out: list = [(name, functools.partial(getattr, state, name)) for name in own]
        if isinstance(state, GuardedState) and state.accumulation is not None:
            out.append(("micro_step", functools.partial(getattr, state.accumulation, "micro_step")))
        return out
    out = [("global_norm", lambda: state.global_norm), ("threshold", lambda: state.threshold)]
    if "scale" in state._fields:
        out.append(("clipped", lambda: jnp.isfinite(state.global_norm) & (state.scale < 1)))
        out.append(("scale", lambda: state.scale))
    if isinstance(state, ZClipState):
        out += [("mean", lambda: state.mean), ("std", lambda: jnp.sqrt(state.var))]
    for name in ("clip_count", "spike_count", "nonfinite_count", "finite_count", "step"):
        if name in state._fields:  # (not `hasattr`: a NamedTuple has a `count` method)
            out.append((name, functools.partial(getattr, state, name)))
    if isinstance(state, AdaGCState):
        for key, per_leaf in (
            ("leaf_threshold", state.leaf_thresholds),
            ("leaf_clip_count", state.leaf_clip_counts),
        ):
            for i, name in enumerate(per_leaf.names):
                out.append((f"{key}/{name}", functools.partial(_item, per_leaf, i)))
    if state.group_norms is not None:
        for i, name in enumerate(state.group_norms.names):
            out.append((f"group_norm/{name}", functools.partial(_item, state.group_norms, i)))
    return out


def _without_nested(state):
    """A wrapper's state without the states it holds (they are found and logged on their own)."""
    nested = _NESTED.get(type(state), ())
    if isinstance(state, GuardedState) and state.accumulation is not None:
        state = state._replace(accumulation=state.accumulation._replace(grads=None))
    return state._replace(**dict.fromkeys(nested)) if nested else state


def _item(group_norms, i):
    return group_norms.values[i]


@jax.jit
def _collect(states: tuple) -> tuple:
    """Every field's value, as fresh arrays (one dispatch for all of them)."""
    return tuple(jnp.array(value()) for state in states for _, value in _fields(state))


def _check_is_state(opt_state) -> None:
    """`metrics` reads a state: not the optimizer (a transformation), nor a factory."""
    if isinstance(opt_state, optax.GradientTransformation):
        raise TypeError(
            "`metrics` reads the optimizer *state*, got the optimizer (an "
            "optax.GradientTransformation): pass `opt_state = optimizer.init(params)`, or the "
            "state returned by `optimizer.update`."
        )
    if callable(opt_state) and not isinstance(opt_state, jax.Array):
        name = getattr(opt_state, "__name__", None) or type(opt_state).__name__
        raise TypeError(
            f"`metrics` reads the optimizer *state*, got the callable `{name}`: build the "
            "optimizer, then pass its state (`opt_state = optimizer.init(params)`)."
        )


def metrics(opt_state) -> dict:
    """Every optclip clip's state in `opt_state`, as a flat dict of arrays ready for a logger.

    Finds the state of every :func:`global_clip`, :func:`autoclip`, :func:`zclip`, :func:`agc`,
    :func:`adagc`, :func:`clipped` and :func:`guarded` (with its loss scale and spike test)
    anywhere in an optimizer state: in ``optax.chain``, ``clipped``, ``optax.MultiSteps``,
    ``optax.masked``, ``optax.inject_hyperparams``, ``optax.multi_transform`` and a Flax NNX
    ``nnx.Optimizer``'s ``opt_state`` (whose Variables are read, so every entry is a plain array
    of this step, not a Variable the next update overwrites).

    Keys are ``"<clip>/<field>"``: ``global_clip/global_norm`` (before clipping),
    ``global_clip/clipped`` (whether this step was scaled down), ``global_clip/scale`` (the factor
    applied), ``global_clip/threshold``, the counters (``clip_count``, ``nonfinite_count``,
    ``step``; ZClip's ``spike_count``, ``mean``, ``std``; ``clipped/skip_count``), AdaGC's
    ``adagc/leaf_threshold/<leaf>`` and ``adagc/leaf_clip_count/<leaf>`` per leaf,
    :func:`guarded`'s ``guarded/global_norm``, ``guarded/skipped``, ``guarded/skip_count``,
    ``guarded/nonfinite_count``, ``guarded/nonfinite_streak`` (non-finite steps in a row),
    ``guarded/step``, ``guarded/micro_step`` (with ``accumulation_steps``),
    ``loss_scale/loss_scale``,
    ``loss_scale/growth_tracker``, ``loss_scale/overflow_count``, ``skip_spikes/norm_threshold``,
    ``skip_spikes/loss_threshold``, ``skip_spikes/spike_count`` and ``skip_spikes/filled``; one
    ``global_clip/group_norm/<group>`` per group with ``group_norms=``. When a chain holds two
    clips of one kind, each is named by where it sits: ``global_clip[0]/global_norm``,
    ``global_clip[1]/global_norm`` (unlike ``optax.tree.get``, which then raises).

    The values are fresh arrays (copies): safe to keep after the state is donated. Call it
    inside or outside ``jit``.

    Args:
      opt_state: an optimizer state (any pytree).

    Returns:
      A dict from names to 0-d arrays, in the order the clips appear in `opt_state`; empty if it
      holds no optclip state.

    Raises:
      TypeError: `opt_state` is an optimizer (a transformation) or a function, not a state; an
        optclip state in it holds a leaf that is not a number or an array of numbers (the
        message names its path in `opt_state`).

    Examples:
      >>> import jax.numpy as jnp, optax, optclip
      >>> opt = optax.chain(optclip.global_clip(1.0, group_norms="leaf"), optax.adam(1e-3))
      >>> params = {"b": jnp.zeros(1), "w": jnp.zeros(2)}
      >>> state = opt.init(params)
      >>> _, state = opt.update({"b": jnp.array([12.]), "w": jnp.array([3., 4.])}, state)
      >>> for name, value in optclip.metrics(state).items():
      ...     print(name, value)
      global_clip/global_norm 13.0
      global_clip/threshold 1.0
      global_clip/clipped True
      global_clip/scale 0.07692308
      global_clip/clip_count 1
      global_clip/nonfinite_count 0
      global_clip/step 1
      global_clip/group_norm/b 12.0
      global_clip/group_norm/w 5.0
    """
    _check_is_state(opt_state)
    found = _find(opt_state)
    counts = collections.Counter(KINDS[type(state)] for _, state in found)
    prefixes = []
    for path, state in found:
        kind = KINDS[type(state)]
        where = ".".join(key_text(k) for k in path)
        prefixes.append(kind if counts[kind] == 1 else f"{kind}[{where}]")
    states = tuple(_plain(_without_nested(s)) for _, s in found)
    for (path, _), state in zip(found, states):
        _checks.check_leaves(state, "`metrics`", path)
    if not found:
        return {}
    names = [f"{prefix}/{name}" for prefix, s in zip(prefixes, states) for name, _ in _fields(s)]
    return dict(zip(names, _collect(states)))
