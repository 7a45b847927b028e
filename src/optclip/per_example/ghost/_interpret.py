"""The per-example loss evaluated equation by equation, with taps at the sites.

Every variable `_shared.place` places a tap at goes through `tap` (its gradient is that
example's gradient of the variable: a site's output gradient, or what it is made of), and at
every tapped site (a use of a ghost leaf, `_plans.ghost_sites`) the operands that are not
parameter views are recorded (the activations, the indices of a lookup). Calls with sites
inside are evaluated inline; rematerialised blocks stay rematerialised (`jax.checkpoint` of
the same evaluation, with their taps in and their records out); a `scan` stacks its records
like its ``ys``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import ad_checkpoint, lax
from jax.experimental import layout
from jax.extend import core as jcore

from optclip.per_example.ghost import _factors, _jaxprs, _sites

try:  # (no public way to bind under an equation's source line; without it, none is kept)
    from jax._src import source_info_util
except ImportError:  # pragma: no cover
    source_info_util = None  # type: ignore[assignment]


@dataclasses.dataclass(frozen=True)
class Tapped:
    """What the tapped pass gives: the losses and aux; `records` (``{record key: (array,
    exponent)}``) and `grads` (the output gradients, ``{site id: tuple of (array, exponent)
    or _pieces.Pieces}``) of the tapped sites, each `scaled` by its exponent per layer and
    example: the arrays laid out ``(*levels, B, ...)`` (the layers of the scans the site is
    inside, then the examples, as a scan stacks them: the examples' axis of each is in
    `record_axes` and `grad_axes`), the exponents ``(*levels, B)``, of size 1 at a level along
    which the weights that read them are the same at every step; the materialised leaves'
    per-example gradients ``{leaf: (B, *shape)}``; the parameter leaves' values; `inputs`:
    the records that are inputs of the loss one site alone reads; `products`: the ``PRODUCT``
    leaves' per-example gradients ``{leaf: _norms.Product}``."""

    losses: Any
    aux: Any
    records: dict
    grads: dict
    example_grads: dict
    leaves: list
    record_axes: dict  # {record key: the examples' axis}
    grad_axes: dict  # {site id: the examples' axis}
    inputs: frozenset = frozenset()
    products: dict = dataclasses.field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.losses.shape[0]

    @property
    def one_by_one(self) -> bool:
        """Whether the examples can be taken one at a time (`example`): not when JAX's explicit
        sharding splits the batch over a mesh (a slice of one example would be split too)."""
        spec = getattr(getattr(jax.typeof(self.losses), "sharding", None), "spec", None)
        return not spec or spec[0] is None

    def example(self, b) -> Tapped:
        """The same for example `b` alone (a batch of one; `b` may be traced; `one_by_one`)."""

        def cut(x, axis):
            if x.dtype == jnp.bfloat16:
                # XLA on a CPU slices bfloat16 in float32, and hoisted a float32 copy of the whole
                # array out of the loop over the examples: tied to `b`, it is not loop-invariant
                x, at = lax.optimization_barrier((x, b))
                return lax.dynamic_slice_in_dim(x, at, 1, axis=axis)
            return lax.dynamic_slice_in_dim(x, b, 1, axis=axis)

        def cut_all(tree, axis):  # (an output gradient's `_pieces.Pieces` is a pytree)
            return jax.tree.map(lambda a: cut(a, axis), tree)

        return dataclasses.replace(
            self,
            losses=cut(self.losses, 0),
            records={k: cut_all(r, self.record_axes[k]) for k, r in self.records.items()},
            grads={i: cut_all(g, self.grad_axes[i]) for i, g in self.grads.items()},
            example_grads={k: cut(g, 0) for k, g in self.example_grads.items()},
            products={k: cut_all(p, 0) for k, p in self.products.items()},
        )


def _located(eqn):
    """The context that gives what `eqn` binds its own source line and name, as
    `jax.core.eval_jaxpr` does: a profile or the compiled module's metadata of the private step
    then names the model's lines (none kept where JAX's private API for it differs)."""
    info: Any = getattr(eqn, "source_info", None)
    try:
        stack = source_info_util.current_name_stack() + info.name_stack
        return source_info_util.user_context(info.traceback, name_stack=stack)
    except (AttributeError, TypeError):  # (a JAX whose private API differs: lines not kept)
        return contextlib.nullcontext()


def bind(eqn, invals):
    """The outputs of `eqn` on `invals`, always as a list."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = params if isinstance(params, tuple) else ((), params)  # (older JAX)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with contextlib.nullcontext() if ctx is None else ctx, _located(eqn):
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# The exponent stored for a record or output gradient that is not finite (its values zeroed):
# above every other, so that a sum of exponents that includes it stays above `FLAGGED`.
FLAG = 2**22
FLAGGED = 2**21


@functools.partial(jax.jit, static_argnames=("axis", "sliced"))
def exponents_of(x, axis: int, sliced: tuple | None = None):
    """Per index of `x`'s first ``axis + 1`` dimensions (the layers of the scans, then the
    examples, as the tapped pass stacks records and output gradients), the exponent ``e`` of
    the power of two near that slice's largest magnitude (``2**(e-1) <= max|x| < 2**e``,
    int32): `_factors.ZERO_EXPONENT` for a slice that is 0, `FLAG` for one with an entry not
    finite; 0 for an `x` not floating. One reduction, no copy of `x` (`_largest_magnitudes`).

    `sliced` (one per level, the first `axis` dimensions; None: all): the levels whose slices
    get their own exponent. The others (a weight applied at every step of its scan, whose
    steps' terms are added) are reduced too, and kept as size 1: one exponent per example for
    all of those steps, so that they are not brought to a common one afterwards."""
    lead = x.shape[: axis + 1]
    if not jnp.issubdtype(x.dtype, jnp.floating) or not x.size:
        return jnp.zeros(lead, jnp.int32)
    m = _largest_magnitudes(x, axis)
    over = () if sliced is None else tuple(i for i, s in enumerate(sliced) if not s)
    if over:  # (then over the steps: a small array, not a reduction of `x` across its layout)
        m = jnp.max(m, axis=over, keepdims=True)
    return _flagged_exponent(m)


@jax.jit
def exponent_of(x):
    """`exponents_of` of `x` as a whole (a scalar)."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or not x.size:
        return jnp.zeros((), jnp.int32)
    return _flagged_exponent(_largest_magnitudes(x, -1))


def _largest_magnitudes(x, axis: int):
    """``max |x|`` over the dimensions after `axis`. Where the last of several is of size 1,
    they are merged into one first (a bitcast), behind a barrier that keeps XLA from folding the
    reshape back into the reduction. Only there: elsewhere the barrier can cost a copy of `x`."""
    if x.ndim > axis + 2 and x.shape[-1] == 1:
        x = lax.optimization_barrier(x.reshape(*x.shape[: axis + 1], -1))
    return jnp.max(jnp.abs(x), axis=tuple(range(axis + 1, x.ndim)))


def _flagged_exponent(m):
    """`_factors.exponent` of the largest magnitudes `m`, `FLAG` where one is not finite."""
    e = _factors.exponent(lax.stop_gradient(m))
    return jnp.where(e > jnp.finfo(m.dtype).maxexp, FLAG, e)


@jax.jit
def scaled(x, e):
    """`x` divided by ``2**e`` (its largest magnitude in [0.5, 1) for the `e` of
    `exponent_of`), zeros where `e` is `FLAG`; `e` holds one exponent per leading index of
    `x` (per example, and per layer of a scan). Exact: a power of two divides exactly. Then
    no product of the outputs in the norms and sums overflows or flushes."""
    if not jnp.issubdtype(x.dtype, jnp.floating) or not x.size:
        return x
    e = jnp.reshape(e, jnp.shape(e) + (1,) * (x.ndim - jnp.ndim(e)))
    bad = e >= FLAGGED
    shift = jnp.where(bad | (e == _factors.ZERO_EXPONENT), 0, e)
    # (``2**(2 - e)`` is a normal number for every normal largest entry's `e`, and the
    # product, in [2, 4), times 1/4 is exact: one power of two built, not two halves)
    up = _factors.power_of_two(2 - shift, x.dtype)
    return jnp.where(bad, jnp.zeros((), x.dtype), (x * up) * jnp.asarray(0.25, x.dtype))


def in_row_major(x):
    """`x` held in the row-major layout (a layout constraint: the same values)."""
    return layout.with_layout_constraint(x, layout.Layout(tuple(range(x.ndim))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tap(y, t, e, pinned=True):
    """`y`, whose output gradient comes out as the gradients of its taps `t` (zeros of `y`'s
    shape) and `e` (a zero per example): the output gradient itself and its `exponent_of`
    (taken in the backward pass, where the gradient is formed: XLA then scales it in place
    after the pass). The forward pass never reads `t` (unlike ``y + t``, nothing of its size
    is formed). Where `pinned` (`_shared.weight_first`) the output gradient is held row-major
    (`in_row_major`): XLA's GPU layout assignment otherwise gave it, in a scanned layer with
    a materialised bias, the layout of that bias's per-example sum, and transposed it for
    every reader; on a CPU, left to XLA, an ``x @ W`` head's logits' gradient was kept twice."""
    del t, e, pinned
    return y


def _tap_forward(y, t, e, pinned):
    del t, e, pinned
    return y, None


def _tap_backward(pinned, _, g):
    g = in_row_major(g) if pinned else g
    return g, g, exponent_of(g).astype(jnp.float32)


tap.defvjp(_tap_forward, _tap_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tap_in_scan(y, t, e, pinned=True):
    """`tap` inside a scan's body: the gradient of `e` is 0 (the output gradients' exponents
    are taken after the backward pass, every step's at once: `exponents_of`)."""
    del t, e, pinned
    return y


def _tap_in_scan_backward(pinned, _, g):
    g = in_row_major(g) if pinned else g
    return g, g, jnp.zeros((), jnp.float32)


tap_in_scan.defvjp(_tap_forward, _tap_in_scan_backward)


def _broadcast(site) -> bool:
    """Whether `site` is an elementwise operation of floats that broadcasts a parameter view
    implicitly (size-1 dimensions: a scale's ``(1, 1, d)`` against ``(1, T, d)``)."""
    eqn = site.eqn
    shape = eqn.outvars[0].aval.shape
    floats = all(_jaxprs.is_float(v) for v in eqn.invars)
    wide = any(eqn.invars[pos].aval.shape != shape for pos, _ in site.views)
    return eqn.primitive.name in _sites.ELEMENTWISE and floats and wide


def _apart(eqn, positions):
    """`eqn` as a function whose backward sums each broadcast view's gradient over the
    broadcast dimensions with the size-1 dimensions dropped first: XLA on the CPU runs ``sum_t
    G * x_hat`` over ``(B, 1, T, d)`` (the example's batch axis of one next to the summed one)
    many times slower than over ``(B, T, d)``. The forward pass and its residuals are the
    equation's own (none for a sum or a difference)."""
    shape = eqn.outvars[0].aval.shape
    wide = [d for d, n in enumerate(shape) if n != 1]

    @jax.custom_vjp
    def f(*invals):
        return bind(eqn, list(invals))

    linear = eqn.primitive.name not in ("mul", "div")  # (its backward reads no operand)

    def forward(*invals):
        return bind(eqn, list(invals)), (None if linear else invals)

    def backward(invals, cotangents):
        if linear:
            invals = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        full = [jnp.broadcast_to(x, shape) if i in positions else x for i, x in enumerate(invals)]
        _, pull = jax.vjp(lambda *xs: bind(eqn, list(xs)), *full)
        grads = list(pull(list(cotangents)))
        for i in positions:
            g = grads[i].reshape([shape[d] for d in wide])
            own = jnp.shape(invals[i])  # () for a scalar against the whole output
            summed = tuple(k for k, d in enumerate(wide) if not own or own[d] == 1)
            grads[i] = jnp.sum(g, axis=summed).reshape(own).astype(grads[i].dtype)
        return tuple(grads)

    f.defvjp(forward, backward)
    return f


def float_outputs(eqn):
    """The indices of `eqn`'s floating-point outputs (the ones tapped)."""
    return [j for j, v in enumerate(eqn.outvars) if _jaxprs.is_float(v)]


def tap_shapes(sites, shapes):
    """One example's taps of `sites` (``{id: site}``): ``{site id: tuple of (ShapeDtypeStruct,
    ShapeDtypeStruct)}``, per variable of `shapes` (``{site id: tuple of ShapeDtypeStruct}``,
    `_shared.Placement.shapes`) its own zeros and a zero for its exponent, stacked along the
    scans the site is in."""
    return {
        i: tuple(
            (
                jax.ShapeDtypeStruct((*site.stack, *shape.shape), shape.dtype),
                jax.ShapeDtypeStruct(site.stack, jnp.float32),
            )
            for shape in shapes[i]
        )
        for i, site in sites.items()
    }


def run(jaxpr, consts, args, plan, taps, records, placed):
    """The outputs of `jaxpr` on `args`, with `taps` (``{site id: taps}``) of `plan`'s sites at
    the variables `placed` (`_shared.Placement`) places them and its `kept` ones named `KEPT`;
    fills `records` (``{record key: recorded operand}``) with the sites' recorded operands."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for index, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        subplan = plan.subplans.get(index)
        tapped = subplan is not None and any(site.id in taps for site in subplan.all_sites())
        if tapped or (placed.kept and not placed.kept.isdisjoint(_jaxprs.call_products(eqn))):
            subplan = subplan or plan._replace(sites={}, subplans={})  # (its products named)
            outs = _call(eqn, subplan, invals, taps, records, placed)
        else:
            site = plan.sites.get(index)
            if site is not None and site.id not in taps and _broadcast(site):
                outs = _apart(eqn, tuple(pos for pos, _ in site.views))(*invals)
            else:
                outs = bind(eqn, invals)
            if site is not None and site.id in taps:
                for key, i in zip(site.records, site.recorded, strict=True):
                    if key not in records:
                        records[key] = invals[i]
        outs = list(outs)
        for j, v in enumerate(eqn.outvars):
            spot = placed.at.get(v)
            if spot is not None and spot.site in taps:
                t, e = taps[spot.site][spot.slot]
                # (a variable shared by the batch, not `batched`, made each example's)
                y = outs[j] if spot.batched else outs[j] + lax.stop_gradient(t)
                outs[j] = (tap_in_scan if spot.depth else tap)(y, t, e, spot.pinned)
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jcore.DropVar):
                env[v] = ad_checkpoint.checkpoint_name(x, KEPT) if v in placed.kept else x
    return [read(v) for v in jaxpr.outvars]


# What a scan's step keeps for the backward pass, as `jax.checkpoint`'s policy: the values
# named `KEPT` (`_shared.Placement.kept`); the rest of the step is computed again there.
KEPT = "optclip.kept"
SCAN_SAVES = jax.checkpoint_policies.save_only_these_names(KEPT)


def _scan(eqn, subplan, invals, taps, records, placed):
    """A `scan` with sites in its body: the body evaluated by `run`, the taps of its sites
    sliced along the scan like its ``xs`` and the records stacked like its ``ys`` (a record
    that is a step's slice of an ``xs`` is that ``xs``, not stacked again). The step is
    rematerialised but for its `KEPT` values (`SCAN_SAVES`): beside every step's records and
    output gradients, the backward pass computes its gates and activations again."""
    params = eqn.params
    body = params["jaxpr"]
    consts, carry = _jaxprs.scan_counts(eqn)
    ids = [site.id for site in subplan.all_sites() if site.id in taps]
    sliced: dict = {}  # {record key: the index of the xs it is a step's slice of}

    def step(state, x):
        xs, step_taps = x
        step_records: dict = {}
        args = [*invals[:consts], *state, *xs]
        outs = run(body.jaxpr, body.consts, args, subplan, step_taps, step_records, placed)
        sliced.update({k: j for k, r in step_records.items() for j, s in enumerate(xs) if s is r})
        stacked = {k: r for k, r in step_records.items() if k not in sliced}
        return outs[:carry], (outs[carry:], stacked)

    state, (ys, scan_records) = lax.scan(
        jax.checkpoint(step, prevent_cse=False, policy=SCAN_SAVES),
        invals[consts : consts + carry],
        (invals[consts + carry :], {i: taps[i] for i in ids}),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    records.update(scan_records)
    records.update({key: invals[consts + carry + j] for key, j in sliced.items()})
    return [*state, *ys]


def _call(eqn, subplan, invals, taps, records, placed):
    """A call, rematerialised block or scan with sites inside, evaluated by `run`."""
    if eqn.primitive.name == "scan":
        return _scan(eqn, subplan, invals, taps, records, placed)
    jaxpr, consts = _jaxprs.sub_jaxpr(eqn)
    if eqn.primitive.name not in _jaxprs.REMATS:
        return run(jaxpr, consts, invals, subplan, taps, records, placed)
    ids = [site.id for site in subplan.all_sites() if site.id in taps]

    def block(invals, block_taps):
        block_records: dict = {}
        outs = run(jaxpr, consts, invals, subplan, block_taps, block_records, placed)
        return outs, block_records

    remat = jax.checkpoint(
        block, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy")
    )
    outs, block_records = remat(invals, {i: taps[i] for i in ids})
    records.update(block_records)
    return outs
