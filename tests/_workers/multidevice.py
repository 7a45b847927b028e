"""Multi-device checks, run in a subprocess by ``tests/test_multidevice.py``.

Needs 8 devices, so JAX must start with them::

    export XLA_FLAGS=--xla_force_host_platform_device_count=8
    python tests/_workers/multidevice.py [SECTION ...]

(every section when none is named; `launch.SECTIONS` lists them, `launch.SLOW_SECTIONS` the
ones only the slow tier runs).

Every check compares a result with the float64 NumPy reference of the same global data
(``tests/reference.py``) and is recorded under a name whose first part (before ``/``) is the
group the test asserts on. The last line of stdout is ``RESULT <json>``: for each check, whether
it passed, its largest relative error and, if it raised, the error. Running all the checks in
one process pays JAX's start-up once.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optclip
from optclip.norms import _groups, _norms

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import compile_setting  # noqa: E402  (tests/_workers/compile_setting.py)
import launch  # noqa: E402  (tests/_workers/launch.py: the sections' names and tiers)
import reference  # noqa: E402  (tests/reference.py: the float64 references)

RTOL = 1e-5
RESULTS: dict[str, dict] = {}


# ----------------------------------------------------------------------------------------------
# Recording results.


@contextlib.contextmanager
def group(name):
    """Records an exception raised by the checks inside as a failed check `name`/error."""
    try:
        yield
    except Exception:  # noqa: BLE001 - every failure is reported, the other groups still run.
        RESULTS[f"{name}/error"] = {"ok": False, "error": traceback.format_exc()[-3000:]}


def record(name, ok, error=0.0, note=None):
    RESULTS[name] = {"ok": bool(ok), "max_rel_err": float(error), "note": note}


def rel_err(got, want) -> float:
    got, want = reference.as_f64(got), reference.as_f64(want)
    if got.shape != want.shape:
        return math.inf
    if np.array_equal(np.isnan(got), np.isnan(want)) and not np.isnan(want).all():
        mask = ~np.isnan(want)
        got, want = got[mask], want[mask]
    elif np.isnan(want).all():
        return 0.0 if np.isnan(got).all() else math.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.where(got == want, 0.0, np.abs(got - want))  # equal infinities too
        rel = np.where(diff == 0, 0.0, diff / np.abs(want))
    return float(np.max(rel, initial=0.0))


def check(name, got, want, rtol=RTOL):
    """`got` (a tree) equals `want` (a tree of float64 arrays) to `rtol`, leaf by leaf."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        record(name, False, math.inf, f"{len(got_leaves)} leaves, want {len(want_leaves)}")
        return
    error = max((rel_err(g, w) for g, w in zip(got_leaves, want_leaves)), default=0.0)
    record(name, error <= rtol, error)


def check_dtypes(name, got, like):
    same = [
        np.dtype(a.dtype) == np.dtype(b.dtype)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(like))
    ]
    record(name, all(same) and len(same) == len(jax.tree.leaves(like)))


# ----------------------------------------------------------------------------------------------
# References.


def ref_norm(tree, p=2.0) -> float:
    return reference.ref_global_norm(jax.tree.leaves(tree), p)


def ref_clip(tree, max_norm, p=2.0):
    """``(clipped tree, norm)`` in float64."""
    norm = ref_norm(tree, p)
    scale = reference.ref_scale(norm, max_norm)
    return jax.tree.map(lambda x: reference.as_f64(x) * scale, tree), norm


def ref_sgd_step(params, grads, max_norm, lr):
    clipped, norm = ref_clip(grads, max_norm)
    return jax.tree.map(lambda p, g: reference.as_f64(p) - lr * g, params, clipped), norm


# ----------------------------------------------------------------------------------------------
# Data: tiny trees mixing leaves split over one axis, two axes, and replicated ones.


def mixed_tree(rng, dtype=np.float32):
    """Gradients and their `PartitionSpec`s on a ("data"=4, "model"=2) mesh."""

    def leaf(*shape):
        return (10.0 ** rng.uniform(-1, 1) * rng.standard_normal(shape)).astype(dtype)

    tree = {
        "both": leaf(8, 3),  # split over data and model together
        "data": leaf(4, 6),  # split over one axis of the 2-D mesh
        "model": leaf(5, 4),  # split over the other one, first dimension replicated
        "grid": leaf(4, 2),  # split over data on one dimension, model on the other
        "bias": leaf(3),  # replicated
        "scalar": leaf(),  # replicated
        "small": [leaf(8) for _ in range(3)],  # same shape and spec: stacked together
        "tiny": [leaf(2) for _ in range(3)],  # replicated and stacked
    }
    specs = {
        "both": P(("data", "model")),
        "data": P("data", None),
        "model": P(None, "model"),
        "grid": P("data", "model"),
        "bias": P(),
        "scalar": P(),
        "small": [P("data")] * 3,
        "tiny": [P()] * 3,
    }
    return tree, specs


def put(tree, specs, mesh):
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.device_put(tree, shardings)


def mesh_2d(axis_types=None):
    kwargs = {} if axis_types is None else {"axis_types": (axis_types,) * 2}
    return jax.make_mesh((4, 2), ("data", "model"), **kwargs)


# ----------------------------------------------------------------------------------------------
# 1. jit over sharded arrays: no axis_name, no code change.


def hlo_collectives(text):
    """(shapes of the results of every all-reduce, number of all-gathers) in compiled HLO."""
    shapes = []
    for line in text.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if match:
            shapes.append(match.group(1))
    gathers = len(re.findall(r"\ball-gather(?:-start)?\(", text))
    return shapes, gathers


def check_hlo(name, compiled_text, max_elements=_norms.STACK_CHUNK):
    """The program all-reduces only small vectors of partial sums (at most `max_elements`: one
    per leaf of a stack, or one per group), never a gradient, and all-gathers nothing."""
    shapes, gathers = hlo_collectives(compiled_text)
    dims = [d for s in shapes for d in re.findall(r"\[([^\]]*)\]", s)]
    sizes = [math.prod(int(n) for n in d.split(",") if n) for d in dims]
    small = bool(shapes) and all(size <= max_elements for size in sizes)
    record(name, small and gathers == 0, note=f"all-reduce {shapes}, all-gather {gathers}")


def jit_checks(kind, axis_types):
    rng = np.random.default_rng(1)
    mesh = mesh_2d(axis_types)
    grads, specs = mixed_tree(rng)
    params, _ = mixed_tree(rng)
    g = put(grads, specs, mesh)
    x = put(params, specs, mesh)

    norm_fn = jax.jit(optclip.global_norm, static_argnames="ord")
    for p in (2.0, 1.0, math.inf, 3.0):
        check(f"jit-{kind}/global_norm/ord={p}", norm_fn(g, ord=p), ref_norm(grads, p))

    clip_fn = jax.jit(optclip.clip_by_global_norm)
    clipped, norm = clip_fn(g, 1.0)
    want, want_norm = ref_clip(grads, 1.0)
    check(f"jit-{kind}/clip_by_global_norm/tree", clipped, want)
    check(f"jit-{kind}/clip_by_global_norm/norm", norm, want_norm)

    opt = optax.chain(optclip.global_clip(1.0), optax.sgd(0.1))

    @jax.jit
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    new_params, state = step(x, opt.init(x), g)
    want_params, want_norm = ref_sgd_step(params, grads, 1.0, 0.1)
    check(f"jit-{kind}/global_clip_step/params", new_params, want_params)
    check(f"jit-{kind}/global_clip_step/norm", optax.tree.get(state, "global_norm"), want_norm)
    kept = jax.tree.map(
        lambda a, s: a.sharding.is_equivalent_to(NamedSharding(mesh, s), a.ndim), new_params, specs
    )
    record(
        f"jit-{kind}/global_clip_step/shardings_kept",
        all(jax.tree.leaves(kept)),
        note=str(jax.tree.map(lambda a: str(a.sharding.spec), new_params)),
    )

    # Adam's state is sharded like the parameters; the sharded run equals one device's.
    adam = optax.chain(optclip.global_clip(1.0), optax.adam(0.1))

    def adam_step(params, grads):
        state = adam.init(params)
        for _ in range(2):
            updates, state = adam.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params, optax.tree.get(state, "global_norm")

    with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes Python floats and int32
        sharded = jax.jit(adam_step)(x, g)
        one_device = jax.jit(adam_step)(*jax.device_put((params, grads), jax.devices()[0]))
    check(f"jit-{kind}/adam_step/equals_one_device", sharded, one_device)

    check_hlo(f"hlo/{kind}/global_norm", norm_fn.lower(g).compile().as_text())
    check_hlo(f"hlo/{kind}/clip_by_global_norm", clip_fn.lower(g, 1.0).compile().as_text())
    check_hlo(f"hlo/{kind}/global_clip_step", step.lower(x, opt.init(x), g).compile().as_text())


# ----------------------------------------------------------------------------------------------
# 2. shard_map and pmap with axis_name.


def smap(fn, mesh, in_specs, out_specs, check_vma=True):
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    )


def shard_map_clip_checks(name, tree, specs, axis_name, mesh, max_norm=1.0, rtol=RTOL):
    """global_norm, clip_by_global_norm and global_clip in a chain, inside one shard_map."""
    opt = optax.chain(optclip.global_clip(max_norm, axis_name=axis_name), optax.sgd(0.1))

    def local(params, grads):
        norm = optclip.global_norm(grads, axis_name=axis_name)
        clipped, clip_norm = optclip.clip_by_global_norm(grads, max_norm, axis_name=axis_name)
        updates, state = opt.update(grads, opt.init(params), params)
        new_params = optax.apply_updates(params, updates)
        return norm, clipped, clip_norm, new_params, optax.tree.get(state, "global_norm")

    params = jax.tree.map(lambda x: np.ones_like(x), tree)
    norm, clipped, clip_norm, new_params, step_norm = smap(
        local, mesh, (specs, specs), (P(), specs, P(), specs, P())
    )(put(params, specs, mesh), put(tree, specs, mesh))

    want, want_norm = ref_clip(tree, max_norm)
    want_params, _ = ref_sgd_step(params, tree, max_norm, 0.1)
    tol = max(rtol, *(reference.rtol_for(x.dtype) for x in jax.tree.leaves(tree)))
    check(f"{name}/global_norm", norm, want_norm, rtol)
    check(f"{name}/clip_by_global_norm/norm", clip_norm, want_norm, rtol)
    check(f"{name}/clip_by_global_norm/tree", clipped, want, tol)
    check_dtypes(f"{name}/clip_by_global_norm/dtypes", clipped, tree)
    check(f"{name}/global_clip_step/norm", step_norm, want_norm, rtol)
    check(f"{name}/global_clip_step/params", new_params, want_params, tol)


def shard_map_clip_vjp_checks(tree, specs, axis_name, mesh):
    """The VJP of clip_by_global_norm over leaves split across devices (the norm's derivative
    all-reduced), at ordinary magnitudes and where ``x . g`` is below float32's range."""
    rng = np.random.default_rng(5)
    cotangent = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), tree)
    cases = {"ordinary": (1.0, 1.0, 0.5), "tiny": (1e-19, 1e-27, 1e-20)}
    for case, (x_size, g_size, c) in cases.items():
        x = jax.tree.map(lambda a, k=x_size: (a * k).astype(np.float32), tree)
        g = jax.tree.map(lambda a, k=g_size: (a * k).astype(np.float32), cotangent)
        error = _clip_vjp_error(x, g, float(np.float32(c)), specs, axis_name, mesh)
        record(f"shard_map-vjp/{case}", error <= RTOL, error)


def _clip_vjp_error(x, g, c, specs, axis_name, mesh) -> float:
    """The largest error of the VJP inside shard_map against the float64 ``s (g - x (x.g) /
    n**2)``, relative to its largest element (its terms cancel)."""

    def pullback(x, g):
        _, vjp = jax.vjp(lambda x: optclip.clip_by_global_norm(x, c, axis_name=axis_name)[0], x)
        return vjp(g)[0]

    got = smap(pullback, mesh, (specs, specs), specs)(put(x, specs, mesh), put(g, specs, mesh))
    x64, g64 = (jax.tree.leaves(jax.tree.map(reference.as_f64, t)) for t in (x, g))
    n = ref_norm(x64)
    dot = sum(float(np.vdot(a, b)) for a, b in zip(x64, g64)) / n**2
    want = np.concatenate([(min(1.0, c / n) * (b - a * dot)).ravel() for a, b in zip(x64, g64)])
    got = np.concatenate([reference.as_f64(a).ravel() for a in jax.tree.leaves(got)])
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def spec_names(spec):
    """The axis names of a `PartitionSpec` as `axis_name` takes them: None, a name or a tuple."""
    axes = tuple(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))
    return None if not axes else axes[0] if len(axes) == 1 else axes


def shard_map_checks():
    rng = np.random.default_rng(2)
    mesh = mesh_2d()

    # A name: every leaf split over "data" of a 1-D mesh.
    mesh_1d = jax.make_mesh((8,), ("data",))
    tree = {
        "w": rng.standard_normal((8, 3)).astype(np.float32),
        "b": rng.standard_normal((16,)).astype(np.float32),
    }
    specs = {"w": P("data"), "b": P("data")}
    shard_map_clip_checks("shard_map-str", tree, specs, "data", mesh_1d)
    shard_map_clip_vjp_checks(tree, specs, "data", mesh_1d)

    # shard_map's own in_specs: a pytree of PartitionSpecs, sharded and replicated mixed.
    tree, specs = mixed_tree(rng)
    shard_map_clip_checks("shard_map-specs", tree, specs, specs, mesh)
    g = put(tree, specs, mesh)

    # Other orders: partial sums psum-ed, or the largest magnitude pmax-ed.
    for p in (1.0, math.inf, 3.0):
        norm = smap(
            lambda t, p=p: optclip.global_norm(t, ord=p, axis_name=specs), mesh, (specs,), P()
        )(g)
        check(f"shard_map-ord/global_norm/ord={p}", norm, ref_norm(tree, p))
        opt = optclip.global_clip(1.0, ord=p, axis_name=specs)
        clipped = smap(lambda t, opt=opt: opt.update(t, opt.init(t))[0], mesh, (specs,), specs)(g)
        check(f"shard_map-ord/global_clip/ord={p}", clipped, ref_clip(tree, 1.0, p)[0])

    check_hlo(
        "hlo/shard_map/clip_by_global_norm",
        smap(
            lambda t: optclip.clip_by_global_norm(t, 1.0, axis_name=specs),
            mesh,
            (specs,),
            (specs, P()),
        )
        .lower(g)
        .compile()
        .as_text(),
        max_elements=1,  # inside shard_map: one psum of the one norm's total per set of axes
    )

    # Optax inside shard_map clips every device by its own local norm; optclip does not.
    want, _ = ref_clip(tree, 1.0)
    optax_tx = optax.clip_by_global_norm(1.0)
    optax_clipped = smap(
        lambda t: optax_tx.update(t, optax_tx.init(t))[0], mesh, (specs,), specs, check_vma=False
    )(g)
    error = max(
        rel_err(a, b) for a, b in zip(jax.tree.leaves(optax_clipped), jax.tree.leaves(want))
    )
    local_norms = smap(
        lambda t: optax.global_norm(t)[None], mesh, (specs,), P(("data", "model")), check_vma=False
    )(g)
    record(
        "shard_map-optax-differs/optax_is_wrong",
        error > 1e-2,
        error,
        note=f"optax's per-device norms {np.round(np.asarray(local_norms), 4).tolist()}, "
        f"true norm {ref_norm(tree):.4f}",
    )
    record(
        "shard_map-optax-differs/per_device_norms_differ",
        np.ptp(np.asarray(local_norms)) > 1e-3
        and not np.allclose(np.asarray(local_norms), ref_norm(tree), rtol=1e-2),
    )
    tx = optclip.global_clip(1.0, axis_name=specs)
    ours = smap(lambda t: tx.update(t, tx.init(t))[0], mesh, (specs,), specs)(g)
    check("shard_map-optax-differs/optclip_is_right", ours, want)


def shard_map_spelling_checks():
    """The other ways to say which axes split the leaves inside shard_map (the slow tier's: the
    fast tier's `shard_map_checks` takes a name and shard_map's own in_specs)."""
    rng = np.random.default_rng(4)
    mesh = mesh_2d()
    tree = {
        "w": rng.standard_normal((8, 3)).astype(np.float32),
        "b": rng.standard_normal((16,)).astype(np.float32),
    }

    # A tuple of names: every leaf split over both axes.
    specs = {"w": P(("data", "model")), "b": P(("data", "model"))}
    shard_map_clip_checks("shard_map-tuple", tree, specs, ("data", "model"), mesh)

    tree, specs = mixed_tree(rng)

    # The same on a mesh with automatic axis types.
    shard_map_clip_checks("shard_map-specs-auto", tree, specs, specs, mesh_2d(AxisType.Auto))

    # A pytree of names: a name, a tuple of names, or None for a replicated leaf.
    names = jax.tree.map(spec_names, specs)
    shard_map_clip_checks("shard_map-names", tree, specs, names, mesh)

    # A prefix of the updates, as shard_map's in_specs may be: one spec for a whole subtree.
    prefix_tree = {
        "layer": {
            "w": rng.standard_normal((8, 4)).astype(np.float32),
            "b": rng.standard_normal((8,)).astype(np.float32),
        },
        "head": {
            "w": rng.standard_normal((4, 2)).astype(np.float32),
            "b": rng.standard_normal((2,)).astype(np.float32),
        },
    }
    prefix = {"layer": P("data"), "head": P()}
    shard_map_clip_checks("shard_map-prefix", prefix_tree, prefix, prefix, mesh)

    # A list of PartitionSpecs for a list of updates (list nodes in `axis_name`).
    leaves = [
        rng.standard_normal((8, 2)).astype(np.float32),
        rng.standard_normal((3,)).astype(np.float32),
    ]
    list_specs = [P(("data", "model")), P()]
    shard_map_clip_checks("shard_map-list", leaves, list_specs, list_specs, mesh)

    # None in in_specs (an input shard_map does not split) on an automatic mesh.
    auto = mesh_2d(AxisType.Auto)
    none_specs = [P("data"), None]
    g = [jax.device_put(leaves[0], NamedSharding(auto, P("data"))), leaves[1]]
    norm = smap(lambda t: optclip.global_norm(t, axis_name=none_specs), auto, (none_specs,), P())(g)
    check("shard_map-none/global_norm", norm, ref_norm(leaves))

    # Without check_vma the reductions are the same.
    g = put(tree, specs, mesh)
    norm = smap(
        lambda t: optclip.global_norm(t, axis_name=specs), mesh, (specs,), P(), check_vma=False
    )(g)
    check("shard_map-no-check-vma/global_norm", norm, ref_norm(tree))


def low_precision_tree(rng):
    """float16 leaves whose squares overflow float16, bfloat16 leaves, and their specs."""
    tree = {
        "f16": (300.0 * rng.standard_normal((8, 16))).astype(np.float16),
        "f16_rep": (500.0 * rng.standard_normal((5,))).astype(np.float16),
        "bf16": rng.standard_normal((16, 4)).astype(jnp.bfloat16),
        "bf16_rep": rng.standard_normal((3,)).astype(jnp.bfloat16),
        "f32": rng.standard_normal((4, 2)).astype(np.float32),
    }
    specs = {
        "f16": P(("data", "model")),
        "f16_rep": P(),
        "bf16": P("data", "model"),
        "bf16_rep": P(),
        "f32": P("data"),
    }
    return tree, specs


def low_precision_checks():
    """float16 leaves whose squares overflow float16 and bfloat16 leaves, inside shard_map."""
    rng = np.random.default_rng(3)
    mesh = mesh_2d()
    tree, specs = low_precision_tree(rng)
    shard_map_clip_checks("shard_map-lowp", tree, specs, specs, mesh, max_norm=100.0)
    # The float16 leaves alone: their sum of squares is far beyond float16's range.
    f16 = {"f16": tree["f16"], "f16_rep": tree["f16_rep"]}
    f16_specs = {"f16": specs["f16"], "f16_rep": P()}
    shard_map_clip_checks("shard_map-lowp-f16", f16, f16_specs, f16_specs, mesh, max_norm=10.0)


def overflow_checks():
    """Squares that overflow or underflow float32: the rescaled fallback, pmax of the largest."""
    rng = np.random.default_rng(4)
    mesh = mesh_2d()
    specs = {"big": P(("data", "model")), "rep": P(), "one": P("data")}
    one = rng.standard_normal((8,)).astype(np.float32)
    one[5] = 4e20  # on one device only: the predicate is on the all-reduced total
    huge = {
        "big": (1e20 * rng.standard_normal((16, 2))).astype(np.float32),
        "rep": (3e19 * rng.standard_normal((3,))).astype(np.float32),
        "one": one,
    }
    shard_map_clip_checks("shard_map-overflow-big", huge, specs, specs, mesh, max_norm=1e20)
    small = jax.tree.map(lambda x: (x * 1e-40).astype(np.float32), huge)
    small["one"] = (rng.standard_normal((8,)) * 1e-25).astype(np.float32)
    shard_map_clip_checks("shard_map-overflow-tiny", small, specs, specs, mesh, max_norm=1e-30)
    g = put(huge, specs, mesh)
    for p in (1.0, 3.0):
        norm = smap(
            lambda t, p=p: optclip.global_norm(t, ord=p, axis_name=specs), mesh, (specs,), P()
        )(g)
        check(f"shard_map-overflow-ord/ord={p}", norm, ref_norm(huge, p))
    # A norm beyond float32's range is inf, and a non-finite norm makes every leaf NaN.
    beyond = dict(huge, big=np.full((16, 2), 3e38, np.float32))
    norm = smap(lambda t: optclip.global_norm(t, axis_name=specs), mesh, (specs,), P())(
        put(beyond, specs, mesh)
    )
    record("shard_map-overflow-inf/norm_is_inf", np.isinf(np.asarray(norm)))
    with_inf = dict(huge, one=np.where(np.arange(8) == 2, np.inf, one).astype(np.float32))
    clipped, norm = smap(
        lambda t: optclip.clip_by_global_norm(t, 1.0, axis_name=specs), mesh, (specs,), (specs, P())
    )(put(with_inf, specs, mesh))
    record(
        "shard_map-overflow-inf/nonfinite_all_nan",
        np.isinf(np.asarray(norm))
        and all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(clipped)),
    )


def nan_and_underflow_checks():
    """Every order's norm is NaN when one device holds a NaN, the infinity norm included (XLA's
    CPU max-reduction of 4096 or more elements drops NaN; the NaN count is all-reduced); squares
    that flush on every device (values ~1e-19) still give the true norm, and a tiny threshold
    against a large norm still clips to it (the scale in two factors)."""
    mesh = mesh_2d()
    specs = {"big": P(("data", "model")), "rep": P()}
    big = np.full((8 * 4096,), 1.5, np.float32)
    big[3 * 4096 + 17] = np.nan  # on one device
    tree = {"big": big, "rep": np.full((3,), 2.0, np.float32)}
    for p in (math.inf, 2.0, 1.0):
        norm = smap(
            lambda t, p=p: optclip.global_norm(t, ord=p, axis_name=specs), mesh, (specs,), P()
        )(put(tree, specs, mesh))
        record(f"shard_map-nan-underflow/nan_norm/ord={p}", np.isnan(np.asarray(norm)))
    tiny = {
        "big": np.linspace(0.5e-19, 1.1e-19, 8 * 4, dtype=np.float32),  # squares flush
        "rep": np.array([1e-19, 1.2e-19], np.float32),
    }
    norm = smap(lambda t: optclip.global_norm(t, axis_name=specs), mesh, (specs,), P())(
        put(tiny, specs, mesh)
    )
    check("shard_map-nan-underflow/tiny_squares", norm, ref_norm(tiny))
    large = {"big": np.full((8 * 4,), 1e10, np.float32), "rep": np.array([1e9, 2e9], np.float32)}
    shard_map_clip_checks(
        "shard_map-nan-underflow/tiny_scale", large, specs, specs, mesh, max_norm=1e-30
    )


def pmap_checks():
    """pmap: a name for leaves with one piece per device, a pytree with None for replicated."""
    rng = np.random.default_rng(5)
    n = jax.device_count()
    split = {
        "w": rng.standard_normal((n, 3, 2)).astype(np.float32),
        "b": rng.standard_normal((n, 4)).astype(np.float32),
    }
    rep = {"c": rng.standard_normal((5,)).astype(np.float32)}
    tree = {**split, **rep}
    want, want_norm = ref_clip(tree, 1.0)

    f = jax.pmap(lambda t: optclip.global_norm(t, axis_name="i"), axis_name="i")
    check("pmap/str/global_norm", f(split), np.full(n, ref_norm(split)))
    f = jax.pmap(lambda t: optclip.global_norm(t, axis_name=("i",)), axis_name="i")
    check("pmap/tuple/global_norm", f(split), np.full(n, ref_norm(split)))

    names = {"w": "i", "b": "i", "c": None}

    def clip(s, r):
        return optclip.clip_by_global_norm({**s, **r}, 1.0, axis_name=names)

    clipped, norm = jax.pmap(clip, axis_name="i", in_axes=(0, None))(split, rep)
    check("pmap/pytree/norm", norm, np.full(n, want_norm))
    check("pmap/pytree/split_leaves", {k: clipped[k] for k in split}, {k: want[k] for k in split})
    check("pmap/pytree/replicated_leaf", clipped["c"], np.broadcast_to(want["c"], (n, 5)))

    opt = optax.chain(optclip.global_clip(1.0, axis_name=names), optax.sgd(0.1))

    def step(s, r):
        grads = {**s, **r}
        params = jax.tree.map(jnp.ones_like, grads)
        updates, state = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates), optax.tree.get(state, "global_norm")

    new_params, norm = jax.pmap(step, axis_name="i", in_axes=(0, None))(split, rep)
    want_params, _ = ref_sgd_step(jax.tree.map(np.ones_like, tree), tree, 1.0, 0.1)
    check("pmap/global_clip_step/norm", norm, np.full(n, want_norm))
    check(
        "pmap/global_clip_step/params",
        {k: new_params[k] for k in split},
        {k: want_params[k] for k in split},
    )


# ----------------------------------------------------------------------------------------------
# 7. The adaptive transforms inside shard_map: the same updates and statistics as on one device.


def adaptive_checks():
    mesh = mesh_2d()
    rng = np.random.default_rng(7)
    # A conv kernel split over its input and output channels, a dense kernel split by rows
    # (AGC's unit axis), a bias split over "model" and a replicated scale.
    params = {
        "conv": rng.standard_normal((3, 3, 4, 2)).astype(np.float32),
        "dense": rng.standard_normal((8, 6)).astype(np.float32),
        "bias": rng.standard_normal((6,)).astype(np.float32),
        "scale": rng.standard_normal((5,)).astype(np.float32),
    }
    specs = {
        "conv": P(None, None, "data", "model"),
        "dense": P("data", None),
        "bias": P("model"),
        "scale": P(),
    }
    steps = [
        jax.tree.map(
            lambda x, k=k: (k + 1.0) * rng.standard_normal(x.shape).astype(np.float32), params
        )
        for k in range(5)
    ]
    steps[3] = jax.tree.map(lambda x: 50.0 * x, steps[3])  # a spike
    cases = {
        "agc": lambda axis_name: optclip.agc(0.05, axis_name=axis_name),
        "autoclip": lambda axis_name: optclip.autoclip(50.0, history=4, axis_name=axis_name),
        "zclip": lambda axis_name: optclip.zclip(
            warmup_steps=2, max_norm=None, axis_name=axis_name
        ),
    }
    for name, make in cases.items():
        one, sharded = make(None), make(specs)

        def run_all(tx, params, grads_seq, axis_name):
            state = tx.init(params)
            outs = []
            for grads in grads_seq:
                updates, state = tx.update(grads, state, params)
                outs.append(updates)
            return outs, optax.tree.get(state, "global_norm"), optax.tree.get(state, "threshold")

        want, want_norm, want_threshold = jax.jit(lambda p, g, tx=one: run_all(tx, p, g, None))(
            params, steps
        )
        got, got_norm, got_threshold = smap(
            lambda p, g, tx=sharded: run_all(tx, p, g, specs),
            mesh,
            (specs, [specs] * len(steps)),
            ([specs] * len(steps), P(), P()),
        )(put(params, specs, mesh), [put(g, specs, mesh) for g in steps])
        check(f"adaptive/{name}/updates", got, want)
        check(f"adaptive/{name}/global_norm", got_norm, want_norm)
        check(f"adaptive/{name}/threshold", got_threshold, want_threshold)


# ----------------------------------------------------------------------------------------------
# 7b. `guarded` inside shard_map: loss scaling, skipped steps and the spike test decide alike on
# every device (the norm is all-reduced), and equal one device's.


def guarded_checks():
    mesh = mesh_2d()
    rng = np.random.default_rng(11)
    tree, specs = mixed_tree(rng)
    params = jax.tree.map(np.ones_like, tree)
    steps = [jax.tree.map(lambda x, k=k: np.float32((1 + 0.1 * k) * x), tree) for k in range(8)]
    steps[5] = jax.tree.map(lambda x: np.float32(100 * x), steps[5])  # a spike
    steps[6] = dict(steps[6], data=steps[6]["data"].copy())
    steps[6]["data"][3, 1] = np.inf  # an overflow, on one device only
    losses = np.float32([2.0, 1.9, 1.8, 1.8, 1.7, 1.7, 1.6, 1.6])
    guards = dict(  # (sgd: optax's adam is not written for strict dtype promotion)
        loss_scale=optclip.DynamicLossScale(2.0**4, growth_interval=2),
        skip_spikes=optclip.SpikeSkip(window=4, k=3.0, min_history=3),
    )
    cases = {
        "global_clip": lambda a: optclip.guarded(
            optax.sgd(0.1), clip=optclip.global_clip(1.0, axis_name=a), **guards
        ),
        "no_clip": lambda a: optclip.guarded(optax.sgd(0.1), axis_name=a, **guards),
        "accumulating": lambda a: optclip.guarded(  # windows of 2: the overflow's is (6, 7)
            optax.sgd(0.1),
            clip=optclip.global_clip(1.0, axis_name=a),
            loss_scale=guards["loss_scale"],
            accumulation_steps=2,
        ),
    }
    planted = {"accumulating": [7]}  # the steps skipped (the window's last micro-batch)

    def run_all(tx, params, grads_seq, losses):
        state, outs, skipped = tx.init(params), [], []
        for i, grads in enumerate(grads_seq):
            scale = optclip.loss_scale(state)
            grads = jax.tree.map(lambda g, s=scale: g * s, grads)
            updates, state = tx.update(grads, state, params, value=losses[i])
            outs.append(updates)
            skipped.append(state.skipped)
        return outs, jnp.stack(skipped), optclip.loss_scale(state), state.global_norm

    for name, make in cases.items():
        one, sharded = make(None), make(specs)
        want = jax.jit(lambda p, g, v, tx=one: run_all(tx, p, g, v))(params, steps, losses)
        got = smap(
            lambda p, g, v, tx=sharded: run_all(tx, p, g, v),
            mesh,
            (specs, [specs] * len(steps), P()),
            ([specs] * len(steps), P(), P(), P()),
        )(put(params, specs, mesh), [put(g, specs, mesh) for g in steps], losses)
        check(f"guarded/{name}/updates", got[0], want[0])
        skips = np.asarray(got[1]).tolist()
        expected = [i in planted.get(name, [5, 6]) for i in range(len(steps))]
        record(
            f"guarded/{name}/skipped",
            skips == np.asarray(want[1]).tolist() and skips == expected,
            note=str(skips),
        )
        check(f"guarded/{name}/loss_scale", got[2], want[2], 0.0)
        check(f"guarded/{name}/global_norm", got[3], want[3])


# ----------------------------------------------------------------------------------------------
# 8. `axis_name` checked against the bound axes and against how each leaf varies over the mesh.


def expect_error(name, fn, error_type, pattern):
    """`fn()` raises `error_type` whose message matches `pattern`."""
    try:
        fn()
    except error_type as error:
        record(name, re.search(pattern, str(error)) is not None, note=str(error)[:400])
        return
    except Exception as error:  # noqa: BLE001 - the wrong error is a failed check, reported
        record(name, False, note=f"{type(error).__name__}: {str(error)[:400]}")
        return
    record(name, False, note="no error")


def axis_check_checks():
    rng = np.random.default_rng(6)
    mesh = mesh_2d()
    tree, specs = mixed_tree(rng)
    g = put(tree, specs, mesh)
    ones = np.ones((8, 3), np.float32)

    def norm_in_shard_map(axis_name, check_vma=True):
        fn = smap(
            lambda t: optclip.global_norm(t, axis_name=axis_name),
            mesh,
            (specs,),
            P(),
            check_vma=check_vma,
        )
        return lambda: fn(g)

    expect_error(
        "axis-checks/unbound_in_shard_map",
        norm_in_shard_map("nope"),
        ValueError,
        r"`axis_name` names mesh axis 'nope', which is not bound: the mesh axes bound here are "
        r"'data', 'model'\.",
    )
    expect_error(
        "axis-checks/unbound_in_pmap",
        lambda: jax.pmap(lambda x: optclip.global_norm(x, axis_name="nope"), axis_name="i")(ones),
        ValueError,
        r"`axis_name` names mesh axis 'nope', which is not bound: the mesh axes bound here are "
        r"'i'\.",
    )
    expect_error(
        "axis-checks/unbound_under_jit",
        lambda: jax.jit(lambda t: optclip.global_norm(t, axis_name="data"))(g),
        ValueError,
        r"which is not bound: no mesh axis is bound here \(`axis_name` is for code inside "
        r"`jax.shard_map` or `jax.pmap`; under `jax.jit` with sharded arrays leave it None\)",
    )
    # The silent overcount: a replicated leaf declared split over "data".
    expect_error(
        "axis-checks/replicated_leaf_declared_split",
        norm_in_shard_map(dict(specs, bias=P("data"))),
        ValueError,
        r"`axis_name` declares leaf `\['bias'\]` split over 'data', but it does not vary over "
        r"that axis: it is replicated there, and global_norm would count it 4 times\.",
    )
    expect_error(
        "axis-checks/a_name_for_every_leaf_counts_replicated_leaves_too",
        norm_in_shard_map("data"),
        ValueError,
        r"declares leaf `\['bias'\]` split over 'data', but it does not vary over that axis",
    )
    # optax's local-norm bug, made by hand: a leaf split over an axis not declared.
    expect_error(
        "axis-checks/undeclared_axis",
        norm_in_shard_map(dict(specs, both=P("data"))),
        ValueError,
        r"Leaf `\['both'\]` varies over mesh axis 'model', which `axis_name` does not declare "
        r"for it: each device would clip by the norm of its own piece\.",
    )
    tx = optclip.global_clip(1.0, axis_name=dict(specs, model=P()))
    expect_error(
        "axis-checks/global_clip_update",
        lambda: smap(lambda t: tx.update(t, tx.init(t))[0], mesh, (specs,), specs)(g),
        ValueError,
        r"Leaf `\['model'\]` varies over mesh axis 'model', which `axis_name` does not declare",
    )
    expect_error(
        "axis-checks/auto_in_pmap",
        lambda: jax.pmap(lambda x: optclip.global_norm(x, axis_name="auto"), axis_name="i")(ones),
        ValueError,
        r"`axis_name='auto'` reads each leaf's mesh axes from JAX's tracking .* here \(under "
        r"`pmap`, or `check_vma=False`\) name the axes",
    )
    expect_error(
        "axis-checks/auto_without_check_vma",
        norm_in_shard_map("auto", check_vma=False),
        ValueError,
        r"`axis_name='auto'` reads each leaf's mesh axes",
    )
    agc = optclip.agc(0.1)
    expect_error(
        "axis-checks/agc_needs_the_specs",
        lambda: smap(lambda t: agc.update(t, agc.init(t), t)[0], mesh, (specs,), specs)(g),
        ValueError,
        r"`agc` inside `shard_map`: leaf `\['both'\]` varies over mesh axes \['data', 'model'\], "
        r"so it is split, but `axis_name` is None\.",
    )


# ----------------------------------------------------------------------------------------------
# 9. `axis_name=None` / "auto" inside shard_map: each leaf's axes read from JAX's tracking.


def auto_checks():
    rng = np.random.default_rng(7)
    mesh = mesh_2d()
    tree, specs = mixed_tree(rng)
    shard_map_clip_checks("auto/none", tree, specs, None, mesh)
    shard_map_clip_checks("auto/auto", tree, specs, "auto", mesh)
    shard_map_clip_checks("auto/auto-axis-types", tree, specs, None, mesh_2d(AxisType.Auto))
    # (the data of `low_precision_checks`: with lr 0.1 no bfloat16 parameter lands near zero,
    # where its rounding would be a large relative error)
    lowp, lowp_specs = low_precision_tree(np.random.default_rng(3))
    shard_map_clip_checks("auto/lowp", lowp, lowp_specs, None, mesh, max_norm=100.0)
    g = put(tree, specs, mesh)
    for p in (1.0, math.inf):
        norm = smap(lambda t, p=p: optclip.global_norm(t, ord=p), mesh, (specs,), P())(g)
        check(f"auto/ord={p}", norm, ref_norm(tree, p))
    for name, tx in {
        "autoclip": optclip.autoclip(50.0, history=4),
        "zclip": optclip.zclip(warmup_steps=1, max_norm=None),
    }.items():
        norm = smap(lambda t, tx=tx: tx.update(t, tx.init(t))[1].global_norm, mesh, (specs,), P())
        check(f"auto/{name}", norm(g), ref_norm(tree))
    # Outside shard_map, "auto" has nothing to reduce: sharded arrays are whole arrays.
    norm = jax.jit(lambda t: optclip.global_norm(t, axis_name="auto"))(g)
    check("auto/jit", norm, ref_norm(tree))


# ----------------------------------------------------------------------------------------------
# 10. Group norms on several devices: under sharded jit, inside shard_map and pmap.


def ref_group_norms(tree, spec, p=2.0):
    names, buckets = _groups.assign(spec, tree)
    leaves = jax.tree.leaves(tree)
    return np.array(
        [
            reference.ref_global_norm([x for x, b in zip(leaves, buckets) if b == i], p)
            for i in range(len(names))
        ]
    )


def group_checks():
    rng = np.random.default_rng(8)
    mesh = mesh_2d()
    tree, specs = mixed_tree(rng)
    tree["one"] = rng.standard_normal((8,)).astype(np.float32)
    tree["one"][3] = 4e20  # a square that overflows, on one device only: the fallback
    specs["one"] = P("data")
    g = put(tree, specs, mesh)

    def groups(t, spec, axis_name=None, p=2.0):
        tx = optclip.global_clip(1.0, axis_name=axis_name, group_norms=spec, ord=p)
        state = tx.update(t, tx.init(t))[1]
        return state.global_norm, state.group_norms.values

    for spec in ("leaf", 1):
        want = ref_group_norms(tree, spec)
        norm, values = jax.jit(lambda t, s=spec: groups(t, s))(g)
        check(f"groups/jit/{spec}/norm", norm, ref_norm(tree))
        check(f"groups/jit/{spec}/values", values, want)
        for label, axis_name in (("specs", specs), ("auto", None)):
            fn = smap(lambda t, s=spec, a=axis_name: groups(t, s, a), mesh, (specs,), (P(), P()))
            norm, values = fn(g)
            check(f"groups/shard_map-{label}/{spec}/norm", norm, ref_norm(tree))
            check(f"groups/shard_map-{label}/{spec}/values", values, want)
        fn = smap(lambda t, s=spec: groups(t, s, p=math.inf)[1], mesh, (specs,), P())
        check(f"groups/shard_map-inf/{spec}", fn(g), ref_group_norms(tree, spec, math.inf))
    names = _groups.assign("leaf", tree)[0]
    check_hlo(
        "hlo/shard_map/group_norms",
        smap(lambda t: groups(t, "leaf")[1], mesh, (specs,), P()).lower(g).compile().as_text(),
        max_elements=len(names) + 1,
    )
    n = jax.device_count()
    split = {
        "w": rng.standard_normal((n, 3, 2)).astype(np.float32),
        "b": rng.standard_normal((n, 4)).astype(np.float32),
    }
    values = jax.pmap(lambda t: groups(t, "leaf", "i")[1], axis_name="i")(split)
    check("groups/pmap", values, np.broadcast_to(ref_group_norms(split, "leaf"), (n, 2)))


# ----------------------------------------------------------------------------------------------
# 11. Stacked layers (``stacked=``): the layer axis sharded under jit (pipeline-style), split
#     inside shard_map and pmap (each device holds some layers), or not split.

LAYERS = 8


def layer_tree(rng):
    """A scanned model's gradients: blocks stacked along axis 0 (one leaf per weight, one layer
    with a square that overflows float32) and leaves outside the stack, with `PartitionSpec`s on
    the ("data"=4, "model"=2) mesh that split the layer axis over "data"."""

    def leaf(*shape):
        return (10.0 ** rng.uniform(-1, 1) * rng.standard_normal(shape)).astype(np.float32)

    blocks = {"w": leaf(LAYERS, 6, 4), "b": leaf(LAYERS, 4), "scale": leaf(LAYERS)}
    blocks["w"][5, 0, 0] = 4e20  # (layer 5 is on the third device along "data")
    tree = {"blocks": blocks, "head": leaf(4, 3), "embed": leaf(8, 4)}
    specs = {
        "blocks": {"w": P("data", None, "model"), "b": P("data"), "scale": P("data")},
        "head": P(),
        "embed": P(None, "model"),
    }
    return tree, specs


def ref_layer_groups(tree, spec, stacked="blocks", p=2.0):
    """The float64 group norms of `tree` with its stacked leaves seen layer by layer."""
    names, buckets = _groups.assign(spec, tree, _groups.check_stacked(stacked))
    members: list[list] = [[] for _ in names]
    for x, b in zip(jax.tree.leaves(tree), buckets):
        for layer, bucket in enumerate(b) if isinstance(b, tuple) else [(None, b)]:
            if bucket < len(names):
                members[bucket].append(x if layer is None else np.take(x, layer, 0))
    return np.array([reference.ref_global_norm(m, p) for m in members])


def check_small_collectives(name, compiled_text, max_elements):
    """Every collective moves at most `max_elements` floats: partial sums, never a gradient."""
    sizes = []
    for line in compiled_text.splitlines():
        match = re.search(r"=\s*(.*?)\s+(?:all-reduce|all-gather|all-to-all)(?:-start)?\(", line)
        if match:
            dims = re.findall(r"\[([^\]]*)\]", match.group(1))
            sizes += [math.prod(int(n) for n in d.split(",") if n) for d in dims]
    record(name, bool(sizes) and max(sizes) <= max_elements, note=f"collective sizes {sizes}")


def layer_checks():
    rng = np.random.default_rng(10)
    tree, specs = layer_tree(rng)
    norm = ref_norm(tree)

    def clip(t, spec, axis_name=None, p=2.0, stacked="blocks", state=None):
        tx = optclip.global_clip(1.0, axis_name=axis_name, group_norms=spec, ord=p, stacked=stacked)
        updates, state = tx.update(t, tx.init(tree) if state is None else state)
        values = None if state.group_norms is None else state.group_norms.values
        return updates, state.global_norm, values

    for kind, mesh in (("explicit", mesh_2d()), ("auto", mesh_2d(AxisType.Auto))):
        g = put(tree, specs, mesh)
        for spec in ("layer", "leaf"):
            fn = jax.jit(lambda t, s=spec: clip(t, s))
            updates, got_norm, values = fn(g)
            check(f"layers/jit-{kind}/{spec}/values", values, ref_layer_groups(tree, spec))
            check(f"layers/jit-{kind}/{spec}/norm", got_norm, norm)
            plain_updates, plain_norm, _ = jax.jit(lambda t: clip(t, None))(g)
            same = np.array_equal(plain_norm, got_norm) and all(
                np.array_equal(a, b)
                for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(plain_updates))
            )
            record(f"layers/jit-{kind}/{spec}/bit_for_bit_without_groups", same)
        check_small_collectives(
            f"layers/hlo/jit-{kind}",
            jax.jit(lambda t: clip(t, "layer")).lower(g).compile().as_text(),
            max_elements=2 * LAYERS,
        )

    mesh = mesh_2d()
    g = put(tree, specs, mesh)
    want = {s: ref_layer_groups(tree, s) for s in ("layer", "leaf")}
    out = (specs, P(), P())
    for spec in ("layer", "leaf"):
        for label, axis_name in (("specs", specs), ("auto", None)):
            fn = smap(lambda t, s=spec, a=axis_name: clip(t, s, a), mesh, (specs,), out)
            updates, got_norm, values = fn(g)
            check(f"layers/shard_map-{label}/{spec}/values", values, want[spec])
            check(f"layers/shard_map-{label}/{spec}/norm", got_norm, norm)
            plain = smap(lambda t, a=axis_name: clip(t, None, a), mesh, (specs,), out)(g)
            same = np.array_equal(plain[1], got_norm) and all(
                np.array_equal(a, b)
                for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(plain[0]))
            )
            record(f"layers/shard_map-{label}/{spec}/bit_for_bit_without_groups", same)
    fn = smap(lambda t: clip(t, "layer", p=math.inf)[2], mesh, (specs,), P())
    check("layers/shard_map-inf", fn(g), ref_layer_groups(tree, "layer", p=math.inf))
    check_small_collectives(
        "layers/hlo/shard_map",
        smap(lambda t: clip(t, "layer")[2], mesh, (specs,), P()).lower(g).compile().as_text(),
        max_elements=2 * LAYERS,
    )

    # The layer axis not split (only the other dimensions are): no offsets.
    rows = {
        "blocks": {"w": P(None, None, "model"), "b": P(), "scale": P()},
        "head": P(),
        "embed": P(),
    }
    fn = smap(lambda t: clip(t, "layer")[2], mesh, (rows,), P())
    check("layers/shard_map-unsplit", fn(put(tree, rows, mesh)), want["layer"])

    # Split over both mesh axes (one layer a device): the specs say in which order.
    both = {"blocks": {k: P(("data", "model")) for k in tree["blocks"]}, "head": P(), "embed": P()}
    fn = smap(lambda t: clip(t, "layer", both)[2], mesh, (both,), P())
    check("layers/shard_map-two-axes", fn(put(tree, both, mesh)), want["layer"])
    fn = smap(lambda t: clip(t, "layer")[2], mesh, (both,), P())
    expect_error(
        "layers/errors/which_axes",
        lambda: fn(put(tree, both, mesh)),
        ValueError,
        r"stacked leaf `blocks/b` holds 1 of its 8 layers here \(its group norms were made by "
        r"`init` for 8\), .* Pass shard_map's `in_specs`",
    )

    # `init` inside shard_map: each device sees its piece; with the specs it knows the split.
    def init_inside(t, axis_name):
        tx = optclip.global_clip(1.0, group_norms="layer", stacked="blocks", axis_name=axis_name)
        return tx.update(t, tx.init(t))[1].group_norms.values

    check(
        "layers/shard_map-init-inside",
        smap(lambda t: init_inside(t, specs), mesh, (specs,), P())(g),
        want["layer"],
    )
    expect_error(
        "layers/errors/init_inside",
        lambda: smap(lambda t: init_inside(t, None), mesh, (specs,), P())(g),
        ValueError,
        r"`global_clip`'s `init` runs inside shard_map on each device's piece of stacked leaf "
        r"`blocks/b`, which varies over mesh axes \['data'\]",
    )

    # AGC: units of each layer's slice, the layer axis split over "data".
    params = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), tree)
    agc = optclip.agc(0.05, axis_name=specs, stacked="blocks", group_norms="layer")
    one = optclip.agc(0.05, stacked="blocks", group_norms="layer")

    def agc_step(tx, p, t):
        updates, state = tx.update(t, tx.init(params), p)
        return updates, state.group_norms.values

    got = smap(lambda p, t: agc_step(agc, p, t), mesh, (specs, specs), (specs, P()))(
        put(params, specs, mesh), g
    )
    check("layers/agc/shard_map", got, jax.jit(lambda p, t: agc_step(one, p, t))(params, tree))
    check("layers/agc/values", got[1], want["layer"])

    # pmap: one layer a device, the split inferred from the layers the state was made for.
    n = jax.device_count()
    stack = {
        "w": rng.standard_normal((n, 3, 2)).astype(np.float32),
        "b": rng.standard_normal((n, 2)).astype(np.float32),
    }
    tx = optclip.global_clip(1.0, group_norms="layer", stacked="blocks", axis_name="i")
    state = tx.init({"blocks": stack})
    split = jax.tree.map(lambda x: x[:, None], stack)  # (devices, 1 layer, ...)
    values = jax.pmap(
        lambda t: tx.update({"blocks": t}, state)[1].group_norms.values, axis_name="i"
    )(split)
    want_pmap = ref_layer_groups({"blocks": stack}, "layer")
    check("layers/pmap", values, np.broadcast_to(want_pmap, (n, n)))


# ----------------------------------------------------------------------------------------------
# 12. Eager leaves on different devices (PyTorch's test_clip_grad_norm_multi_device).


def device_checks():
    rng = np.random.default_rng(9)
    devices = jax.devices()
    tree = {
        "layer0": {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.ones(3)},
        "layer1": {"w": rng.standard_normal((3, 2)).astype(np.float32), "b": np.ones(2)},
        "layer2": (1e20 * rng.standard_normal((8,))).astype(np.float32),
    }
    mesh = jax.make_mesh((4,), ("d",), devices=devices[4:])
    placed = {
        "layer0": jax.device_put(tree["layer0"], devices[0]),
        "layer1": jax.device_put(tree["layer1"], devices[1]),
        "layer2": jax.device_put(tree["layer2"], NamedSharding(mesh, P("d"))),
    }
    where = jax.tree.map(lambda x: x.sharding.device_set, placed)
    record(
        "devices/optax_fails",
        _raises(lambda: optax.tree.norm(placed)),
        note="optax.tree.norm of leaves on different devices",
    )
    check("devices/global_norm", optclip.global_norm(placed), ref_norm(tree))
    check("devices/global_norm/ord=1", optclip.global_norm(placed, ord=1), ref_norm(tree, 1.0))
    clipped, norm = optclip.clip_by_global_norm(placed, 1.0)
    want, want_norm = ref_clip(tree, 1.0)
    check("devices/clip_by_global_norm/norm", norm, want_norm)
    check("devices/clip_by_global_norm/tree", clipped, want)
    tx = optclip.global_clip(1.0, group_norms=1)
    updates, state = tx.update(placed, tx.init(placed))
    check("devices/global_clip/updates", updates, want)
    check("devices/global_clip/groups", state.group_norms.values, ref_group_norms(tree, 1))
    stayed = jax.tree.map(
        lambda x, d: x.sharding.device_set == d, (clipped, updates), (where, where)
    )
    record("devices/leaves_stay_on_their_devices", all(jax.tree.leaves(stayed)))


# ----------------------------------------------------------------------------------------------
# 11. `check_split`: a leaf declared split that is the same on every device (pmap, where JAX does
# not track variation), and `reraise_errors` giving back the errors raised on the devices.


def _error_of(fn):
    """The exception `fn()` raises inside `optclip.reraise_errors()` (None if none)."""
    try:
        with optclip.reraise_errors():
            jax.block_until_ready(fn())
    except Exception as error:  # noqa: BLE001 - returned, for the checks to look at
        return error
    return None


def _is(error, error_type, pattern) -> bool:
    return isinstance(error, error_type) and re.search(pattern, str(error)) is not None


def split_check_checks():
    rng = np.random.default_rng(11)
    n = jax.device_count()
    split = {
        "w": rng.standard_normal((n, 3, 2)).astype(np.float32),
        "b": rng.standard_normal((n, 4)).astype(np.float32),
        "z": np.zeros((n, 2), np.float32),  # zero everywhere: never reported
    }
    rep = {"c": rng.standard_normal((5,)).astype(np.float32)}
    good = {"w": "i", "b": "i", "z": "i", "c": None}

    def run(axis_name, average=False):
        def step(s, r):
            grads = {**s, **r}
            if average:
                grads = jax.lax.pmean(grads, "i")  # the same on every device
            optclip.check_split(grads, axis_name)
            return optclip.global_norm(grads, axis_name=axis_name)

        return lambda: jax.pmap(step, axis_name="i", in_axes=(0, None))(split, rep)

    error = _error_of(run(good))
    record("split-check/pmap_split_leaves_pass", error is None, note=repr(error)[:300])
    norm = jax.pmap(
        lambda s, r: optclip.global_norm({**s, **r}, axis_name=good),
        axis_name="i",
        in_axes=(0, None),
    )(split, rep)
    check("split-check/pmap_norm_unchanged", norm, np.full(n, ref_norm({**split, **rep})))

    error = _error_of(run("i", average=True))  # pmean-ed, then declared split: the mistake
    record(
        "split-check/pmap_averaged_grads_reported",
        _is(
            error,
            optclip.AxisNameError,
            r"same on every device: `\['b'\]` over 'i', `\['c'\]` over 'i', `\['w'\]` over "
            r"'i'\. .*sqrt\(n\) times too large",
        ),
        note=repr(error)[:400],
    )
    error = _error_of(run({**good, "c": "i"}))  # only the leaf passed whole is replicated
    record(
        "split-check/pmap_replicated_leaf_named_alone",
        _is(error, optclip.AxisNameError, r"device: `\['c'\]` over 'i'\. Such"),
        note=repr(error)[:400],
    )
    record("split-check/no_stale_error_after", not _raises(jax.effects_barrier))
    try:  # without `reraise_errors`: JAX's runtime error, with the message inside
        jax.block_until_ready(run("i", average=True)())
        record("split-check/jax_runtime_error_without_reraise", False, note="no error")
    except jax.errors.JaxRuntimeError as error:
        record("split-check/jax_runtime_error_without_reraise", "AxisNameError" in str(error))
    _raises(jax.effects_barrier)  # (JAX keeps the other devices' errors: let them out here)

    # shard_map without variation tracking: the same check, per mesh axis.
    mesh = mesh_2d()
    tree, specs = mixed_tree(rng)
    g = put(tree, specs, mesh)

    def in_shard_map(axis_name):
        fn = smap(
            lambda t: optclip.check_split(t, axis_name) or jnp.zeros(()),
            mesh,
            (specs,),
            P(),
            check_vma=False,
        )
        return lambda: fn(g)

    error = _error_of(in_shard_map(specs))
    record("split-check/shard_map_specs_pass", error is None, note=repr(error)[:300])
    wrong = {**specs, "data": P("data", "model")}  # replicated over "model", declared split
    error = _error_of(in_shard_map(wrong))
    record(
        "split-check/shard_map_axis_named",
        _is(error, optclip.AxisNameError, r"device: `\['data'\]` over 'model'\. Such"),
        note=repr(error)[:400],
    )
    # With variation tracking (check_vma=True) the same mistake is caught when tracing.
    fn = smap(lambda t: optclip.check_split(t, wrong) or jnp.zeros(()), mesh, (specs,), P())
    expect_error(
        "split-check/shard_map_tracked_at_trace",
        lambda: fn(g),
        optclip.AxisNameError,
        r"declares leaf `\['data'\]` split over 'model', but it does not vary over that axis",
    )

    # nonfinite="raise" under pmap: every device raises; one NonFiniteNormError comes back.
    clip = optclip.global_clip(1.0, axis_name="i", nonfinite="raise")
    bad = dict(split, w=split["w"].copy())
    bad["w"][3, 0, 0] = np.nan
    error = _error_of(
        lambda: jax.pmap(lambda t: clip.update(t, clip.init(t))[0], axis_name="i")(bad)
    )
    record(
        "split-check/pmap_nonfinite_raise",
        _is(  # (the device that reports may be one whose own pieces are finite)
            error,
            optclip.NonFiniteNormError,
            r"leaves with NaN or inf: (`\['w'\]`|none here \(.* is on another device\))",
        ),
        note=repr(error)[:400],
    )
    record("split-check/no_stale_error_after_nonfinite", not _raises(jax.effects_barrier))


def _raises(fn) -> bool:
    try:
        jax.block_until_ready(fn())
    except Exception:  # noqa: BLE001 - any error is what is recorded
        return True
    return False


SECTIONS = {
    "jit-explicit": lambda: jit_checks("explicit", None),
    "shard_map": shard_map_checks,
    "shard_map-spellings": shard_map_spelling_checks,
    "shard_map-lowp": low_precision_checks,
    "shard_map-overflow": overflow_checks,
    "shard_map-nan-underflow": nan_and_underflow_checks,
    "pmap": pmap_checks,
    "axis-checks": axis_check_checks,
    "split-check": split_check_checks,
    "jit-auto": lambda: jit_checks("auto", AxisType.Auto),
    "adaptive": adaptive_checks,
    "guarded": guarded_checks,
    "auto": auto_checks,
    "groups": group_checks,
    "layers": layer_checks,
    "devices": device_checks,
}


def main(names: list[str]):
    """Runs the sections named (every one if none is), each under `group`, and prints each
    one's time to stderr."""
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as in tests/conftest.py
    compile_setting.follow_few_optimizations()  # (as the test processes compile)
    if jax.device_count() != 8:
        sys.exit("Needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8.")
    assert list(SECTIONS) == list(launch.SECTIONS), "launch.SECTIONS lists these sections"
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        sys.exit(f"Unknown sections {unknown}; the sections are {list(SECTIONS)}.")
    for name in names or SECTIONS:
        start = time.perf_counter()
        with group(name):
            SECTIONS[name]()
        print(f"section {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print("RESULT " + json.dumps(RESULTS))


if __name__ == "__main__":
    main(sys.argv[1:])
