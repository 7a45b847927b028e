"""`ghost_report`: for a loss and its arguments, how each parameter leaf's per-example norm is
computed by ``clipped_grad(..., method="auto")``, through which operations, and why."""

from __future__ import annotations

import dataclasses

import jax

from optclip import _checks
from optclip.per_example.ghost import _args, _batch, _passes, _plans


@dataclasses.dataclass(frozen=True)
class LeafReport:
    """One parameter leaf: `mode` is ``"ghost"`` (norm from the uses' inputs and output
    gradients, no per-example gradient formed), ``"materialised"`` (its per-example gradient is
    formed, for this leaf only) or ``"unused"``; `operations` names the primitive of each use;
    `reason` says why."""

    mode: str
    operations: tuple
    reason: str


class GhostReport(dict):
    """``{leaf path: LeafReport}``, printed as one line per leaf."""

    def __str__(self) -> str:
        width = max((len(k) for k in self), default=0)
        return "\n".join(
            f"{path:<{width}}  {r.mode:<12}  {', '.join(r.operations) or '-'}: {r.reason}"
            for path, r in self.items()
        )


def ghost_report(
    fun,
    *args,
    argnums=0,
    batch_argnums=1,
    has_aux=False,
    keep_batch_dim=True,
    prng_argnum=None,
    **kwargs,
) -> GhostReport:
    """Says, for each leaf of the differentiated arguments, whether ``clipped_grad(fun, ...,
    method="auto")`` computes its per-example norms without per-example gradients (ghost) or
    materialises them, through which operations, and why.

    Args:
      fun, argnums, batch_argnums, has_aux, keep_batch_dim, prng_argnum: as for
        :func:`clipped_grad`.
      args, kwargs: the positional and keyword arguments the clipped function would be called
        with (the batch arguments with their batch axis; only shapes and dtypes are used).

    Returns:
      A dict-like ``{leaf path: LeafReport(mode, operations, reason)}``, printed one line per
      leaf.

    Examples:
      >>> import jax, jax.numpy as jnp, optclip
      >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
      >>> loss = lambda p, x: jnp.sum(jnp.sin(x @ p["w"] + p["b"]))
      >>> print(optclip.ghost_report(loss, params, jnp.ones((8, 3))))
      ['b']  materialised  add: elementwise `add` (a bias or a scale): per-example gradient of the
      parameter's size
      ['w']  ghost         dot_general: ghost: 1 use(s), dense
    """
    argnum_tuple, batch = _args.check_static(
        argnums, batch_argnums, 1.0, 1.0, "auto", prng_argnum, None
    )
    _checks.check_bool(has_aux, "has_aux")
    _checks.check_bool(keep_batch_dim, "keep_batch_dim")
    _args.check_leaves(args, argnum_tuple, batch, "`ghost_report`")
    size = _args.batch_size(args, kwargs, batch)
    args = _args.split_keys(args, prng_argnum, size)
    s = _batch.Settings(
        argnums,
        argnum_tuple,
        _args.in_axes(len(args), batch, prng_argnum),
        1.0,
        False,
        True,
        None,
        None,
        None,
    )
    one = _args.per_example(fun, has_aux, batch, keep_batch_dim)
    flat = _batch.flatten(args, kwargs, s)
    _, _, plan = _passes.trace(one, flat)
    plans = _plans.plan_leaves(list(plan.all_sites()), sum(flat.params))
    if isinstance(argnums, int):
        paths = _paths(args[argnums])
    else:
        paths = [f"[{k}]{p}" for k, i in enumerate(argnum_tuple) for p in _paths(args[i])]
    report = GhostReport()
    for path, leaf in zip(paths, plans, strict=True):
        ops = tuple(use.site.eqn.primitive.name for use in leaf.uses)
        report[path or "<array>"] = LeafReport(leaf.mode.value, ops, leaf.reason)
    return report


def _paths(tree):
    """The key path of each leaf of `tree`, as text."""
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
