"""`clipped_grad`: the sum of per-example clipped gradients, a drop-in for
`jax_privacy.clipped_grad` (2.0), ghost where it can be."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optclip import _checks
from optclip.per_example.ghost import _args, _batch, _eager, _materialised, _passes


class AuxiliaryOutput(NamedTuple):
    """The per-example outputs of a :func:`clipped_grad` function, as jax_privacy's
    ``AuxiliaryOutput``: the fields not asked for are None."""

    values: Any  # each example's loss, shape (B,) (with ``return_values=True``)
    grad_norms: Any  # each example's gradient norm before clipping, shape (B,), float32
    aux: Any  # the aux output of `fun`, per example (with ``has_aux=True``)


RELATIONS = {"ADD_OR_REMOVE_ONE": 1.0, "REPLACE_ONE": 2.0, "REPLACE_SPECIAL": 1.0}


@dataclasses.dataclass(frozen=True)
class ClippedGradFn:
    """The function `clipped_grad` returns, with its L2 sensitivity (as jax_privacy's
    ``BoundedSensitivityCallable``: `l2_norm_bound`, `has_aux`, `sensitivity`)."""

    fun: Callable[..., Any]
    l2_norm_bound: Any
    has_aux: bool

    def __call__(self, *args, **kwargs):
        return self.fun(*args, **kwargs)

    def sensitivity(self, neighboring_relation="REPLACE_SPECIAL"):
        """The L2 sensitivity under `neighboring_relation` (a ``dp_accounting``
        ``NeighboringRelation`` or its name): the bound, twice it for replace-one."""
        name = getattr(neighboring_relation, "name", neighboring_relation)
        if name not in RELATIONS:
            raise ValueError(
                f"`neighboring_relation` must be one of {sorted(RELATIONS)}, got "
                f"{neighboring_relation!r}."
            )
        return RELATIONS[name] * self.l2_norm_bound


def _squeeze_axis_1(x):
    """jax_privacy's squeeze of a size-1 second axis of per-example aux outputs."""
    if hasattr(x, "shape") and len(x.shape) >= 2 and x.shape[1] == 1:
        return jnp.squeeze(x, axis=1)
    return x


def _microbatched(engine, one, args, kwargs, padding, s, size: int, microbatch_size):
    """`engine` over the batch, or over consecutive microbatches of `microbatch_size` examples
    one after another (`lax.scan`), the clipped sums added up."""
    if microbatch_size is None or microbatch_size >= size:
        return engine(one, args, kwargs, padding, s)
    if size % microbatch_size:
        raise ValueError(
            f"`microbatch_size` ({microbatch_size}) must divide the batch size ({size})."
        )
    count = size // microbatch_size
    split = lambda x: x.reshape(count, microbatch_size, *x.shape[1:])  # noqa: E731
    batched = [jax.tree.map(split, a) if ax == 0 else None for a, ax in zip(args, s.axes)]
    xs = (batched, jax.tree.map(split, kwargs), split(padding))

    def chunk(part):
        part_args = tuple(p if ax == 0 else a for a, p, ax in zip(args, part[0], s.axes))
        return engine(one, part_args, part[1], part[2], s)

    first = jax.eval_shape(chunk, jax.tree.map(lambda x: x[0], xs))
    zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), first[0])

    def body(total, part):
        grads, *rest = chunk(part)
        return jax.tree.map(jnp.add, total, grads), tuple(rest)

    total, rest = lax.scan(body, zeros, xs)
    merge = lambda x: x.reshape(size, *x.shape[2:])  # noqa: E731
    return (total, *jax.tree.map(merge, rest))


def clipped_grad(
    fun: Callable,
    argnums=0,
    has_aux: bool = False,
    *,
    l2_clip_norm,
    rescale_to_unit_norm: bool = False,
    normalize_by=1.0,
    batch_argnums=1,
    keep_batch_dim: bool = True,
    return_values: bool = False,
    return_grad_norms: bool = False,
    pre_clipping_transform: Callable | None = None,
    microbatch_size: int | None = None,
    nan_safe: bool = True,
    dtype=None,
    prng_argnum: int | None = None,
    spmd_axis_name=None,
    method: str = "auto",
) -> ClippedGradFn:
    r"""Creates a function computing the sum of per-example gradients, each clipped.

    .. math::
        \frac{1}{\nu} \sum_{b=1}^{B} g_b \cdot \min\!\Big(1, \frac{c}{\|g_b\|_2}\Big), \quad
        g_b = \nabla_\theta\, \ell(\theta, x_b)

    The clipping step of DP-SGD with the signature and semantics of
    ``jax_privacy.clipped_grad`` (2.0), so that switching is a change of import: the same
    arguments, the same outputs, padding examples and keys. With ``method="auto"`` (default)
    the per-example norms ``||g_b||`` are computed without forming ``g_b`` where the loss uses a
    parameter through a dense layer or einsum (``dot_general``, with sequence and head
    dimensions), an embedding lookup (``gather``) or a convolution by its kernel
    (``conv_general_dilated``, its features grouped or not): from each use's input and output
    gradient (ghost clipping), the cross terms of a parameter used more than once (tied
    embeddings, a kernel applied twice) included; nested ``jit``, ``checkpoint`` and
    ``lax.scan`` (stacked layers, weights shared across steps) are seen through. A parameter
    used by any other operation (a bias, a scale, ``sin(w)``, a ``cond``...) has its
    per-example gradient materialised, that leaf only: the backward pass gives it, each
    example having its own copy of that leaf. A use no gradient
    flows back through (``lax.stop_gradient``, a comparison, ``has_aux``'s outputs) is none:
    a frozen table costs nothing per example. The clipped sum
    comes from the same inputs and output gradients, each example's weighted by its factor
    (book-keeping: no second backward pass). ``method="vmap"``
    materialises every per-example gradient (``jax.vmap(jax.grad(...))``) and clips it with
    :func:`per_example_clip`'s rules (the reference; like it, it reports 0 for an example whose
    gradient is entirely below ~1e-19, whose squares all flush). :func:`ghost_report` says
    which leaves go ghost, and why.

    Differences from jax_privacy on purpose: the norm is exact at every magnitude (accumulated
    in float32 for float16/bfloat16 models; an example whose squares overflow float32 is
    clipped, not zeroed), and so is the clipped sum (each example's records and output
    gradients are held divided by a power of two near their largest magnitude, so no side of
    a layer's product leaves its dtype's normal range); with ``nan_safe=True`` an
    example whose gradient is not finite is dropped (contributes zero; jax_privacy zeroes its
    non-finite entries and keeps the rest); with ``nan_safe=False`` it makes the sum NaN.
    ``pre_clipping_transform`` (default none) needs the per-example gradients: given one,
    ``"auto"`` runs as ``"vmap"``. The norms' matrix products take the precision of the layers'
    products (JAX's default: TF32 on a GPU, bfloat16 on a TPU, float32 on a CPU); for float32
    norms everywhere, call it under ``jax.default_matmul_precision("highest")``.

    Called outside ``jax.jit`` (or any transformation of its arguments), a call runs as one
    compiled program: compiled the first time for its shapes, and kept for the next calls
    (the eight latest programs). The arrays the loss closes over are read at every call, as
    eagerly; a Python number among the arguments, or a scalar the loss closes over, is
    compiled in, so that each new value compiles again (pass a number that changes at every
    call as an array). A custom derivative rule or a callback in the loss is the compiling
    call's, as under ``jax.jit``: a value it reads from outside the loss (a global, a
    closed-over variable) that changes between calls must reach it through the loss's
    arguments. With a `pre_clipping_transform`, or under ``jax.disable_jit()``, the
    operations run one at a time.

    Args:
      fun: the loss, ``fun(*args) -> loss`` (or ``(loss, aux)`` with `has_aux`): a real scalar
        for the examples it is given (one, with a leading axis of size 1 if
        `keep_batch_dim`).
      argnums: the argument(s) differentiated (no batch axis): an int, or a sequence of ints
        (the gradient is then a tuple).
      has_aux: `fun` returns ``(loss, aux)``; aux is returned per example.
      l2_clip_norm: the largest per-example norm ``c`` (>= 0; inf for no clipping).
      rescale_to_unit_norm: also divide by ``c`` (sensitivity 1).
      normalize_by: ``nu``, the divisor of the sum (> 0).
      batch_argnums: the argument(s) split into examples along their leading axis.
      keep_batch_dim: pass each example with a leading axis of size 1 (default) or without.
      return_values: also return the per-example losses.
      return_grad_norms: also return the per-example norms (before clipping).
      pre_clipping_transform: a function of one example's gradient applied before clipping.
      microbatch_size: examples computed at once (it must divide the batch); the rest follow
        one microbatch after another.
      nan_safe: drop examples of non-finite gradient (default) rather than propagate NaN.
      dtype: the dtype of the returned gradient (default: the parameters').
      prng_argnum: an argument holding a key (or a tree of keys), split into one per example.
      spmd_axis_name: passed to `jax.vmap` over the batch (a batch sharded over a mesh axis).
      method: ``"auto"`` (ghost norms where the operations allow) or ``"vmap"``.

    Returns:
      A `ClippedGradFn` ``g(*args, is_padding_example=None, **kwargs)``: keyword arguments are
      split into examples too; examples flagged in `is_padding_example` (a (B,) bool array)
      contribute exactly zero. It returns the clipped sum (the structure of the `argnums`
      arguments), or with `has_aux`, `return_values` or `return_grad_norms` the pair
      ``(grads, AuxiliaryOutput(values, grad_norms, aux))``, the fields not asked for None.
      ``g.sensitivity()`` is ``c / nu`` (1 / nu with `rescale_to_unit_norm`), twice that for
      replace-one.

    Raises:
      ValueError: `argnums` and `batch_argnums` overlap or are empty or negative,
        `normalize_by` <= 0, a concrete `l2_clip_norm` is negative or NaN, `method` is unknown,
        the batch arguments' leading sizes differ, they hold no arrays, a keyword argument has
        no batch axis, or `microbatch_size` does not divide the batch.
      TypeError: `fun` does not return a real scalar per example, `argnums` names an argument
        not given, a differentiated leaf is not floating-point or complex (an int, a bool, a
        key), or an argument is of the wrong type.

    Examples:
      >>> import jax.numpy as jnp, numpy as np, optclip
      >>> loss = lambda w, x: 0.5 * jnp.mean((x @ w) ** 2)
      >>> g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
      >>> x = jnp.array([[3.0, 4.0], [0.3, 0.4]])
      >>> grads, aux = g(jnp.array([1.0, 0.0]), x)
      >>> print(aux.grad_norms, np.round(np.float64(grads), 4))
      [15.    0.15] [0.69 0.92]

    References:
      Goodfellow, 2015, Efficient Per-Example Gradient Computations,
      https://arxiv.org/abs/1510.01799; Li et al., 2022, Large Language Models Can Be Strong
      Differentially Private Learners (ghost clipping), https://arxiv.org/abs/2110.05679;
      Bu et al., 2023, Differentially Private Optimization on Large Model at Small Cost
      (book-keeping), https://arxiv.org/abs/2210.00038
    """
    argnum_tuple, batch = _args.check_static(
        argnums,
        batch_argnums,
        normalize_by,
        l2_clip_norm,
        method,
        prng_argnum,
        microbatch_size,
    )
    for value, name in (
        (has_aux, "has_aux"),
        (keep_batch_dim, "keep_batch_dim"),
        (return_values, "return_values"),
        (return_grad_norms, "return_grad_norms"),
        (nan_safe, "nan_safe"),
        (rescale_to_unit_norm, "rescale_to_unit_norm"),
    ):
        _checks.check_bool(value, name)
    one = _args.per_example(fun, has_aux, batch, keep_batch_dim)
    ghost = method == "auto" and pre_clipping_transform is None
    engine = _passes.ghost_pass if ghost else _materialised.vmap_pass
    with_aux = has_aux or return_values or return_grad_norms

    def finish(one, args, kwargs, padding, s):
        size = padding.shape[0]
        # (a batch of no examples: nothing to compute, its shapes are vmap's to give)
        chosen = engine if size else _materialised.vmap_pass
        grads, norms, values, aux = _microbatched(
            chosen, one, args, kwargs, padding, s, size, microbatch_size
        )
        if not (isinstance(normalize_by, (int, float)) and normalize_by == 1):
            grads = jax.tree.map(lambda g: g / normalize_by, grads)
        if not with_aux:
            return grads
        if keep_batch_dim:
            aux = jax.tree.map(_squeeze_axis_1, aux)
        return grads, AuxiliaryOutput(
            values=values if return_values else None,
            grad_norms=norms if return_grad_norms else None,
            aux=aux if has_aux else None,
        )

    programs = _eager.Programs(finish)

    def clipped_fn(*args, is_padding_example=None, **kwargs):
        _args.check_leaves(args, argnum_tuple, batch, "`clipped_grad`")
        size = _args.batch_size(args, kwargs, batch)
        padding = _args.padding_mask(is_padding_example, size)
        args = _args.split_keys(args, prng_argnum, size)
        s = _batch.Settings(
            argnums,
            argnum_tuple,
            _args.in_axes(len(args), batch, prng_argnum),
            l2_clip_norm,
            rescale_to_unit_norm,
            nan_safe,
            dtype,
            pre_clipping_transform,
            spmd_axis_name,
        )
        # Eager: one compiled program (`_eager`), not the engine's operations one at a time.
        # (A `pre_clipping_transform`, whose arrays it may close over would be compiled in,
        # runs as it is.)
        if pre_clipping_transform is None and _eager.is_eager((args, kwargs, padding)):
            return programs(one, args, kwargs, padding, s)
        return finish(one, args, kwargs, padding, s)

    bound = (1.0 if rescale_to_unit_norm else l2_clip_norm) / normalize_by
    return ClippedGradFn(clipped_fn, bound, with_aux)
