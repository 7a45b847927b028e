"""One process of a ``jax.distributed`` run, started by ``tests/test_multidevice.py``.

Usage (one command per process, each with 2 CPU devices)::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python tests/_workers/distributed.py PROCESS_ID NUM_PROCESSES PORT

The processes join over 127.0.0.1:PORT with gloo CPU collectives and build the same global
gradients from one seed, sharded over a ("data", "model") mesh of every process's devices. Each
process checks the shards it holds against the float64 NumPy reference of the whole global data
(an element of a sharded result is right only if the norm was reduced over every process), and
prints ``RESULT <json>`` as the last line of stdout. `clipped_grad` runs there too, on a global
batch split over the processes.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optclip

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))  # (ghost_models)
import compile_setting  # noqa: E402  (tests/_workers/compile_setting.py)
from multidevice import (  # noqa: E402  (the helpers and references of the one-process checks)
    RESULTS,
    check_hlo,
    group,
    mixed_tree,
    record,
    ref_clip,
    ref_group_norms,
    ref_norm,
    ref_sgd_step,
    rel_err,
)


def global_array(x, mesh, spec):
    """The global array `x` (the same NumPy data in every process), each process placing its
    own shards."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def check_shards(name, got, want, rtol=1e-5):
    """Every shard this process holds equals the matching block of the float64 reference."""
    errors, count = [], 0
    for leaf, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        ref = np.asarray(ref, np.float64)
        for shard in leaf.addressable_shards:
            errors.append(rel_err(np.asarray(shard.data), ref[shard.index]))
            count += 1
    same = len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
    error = max(errors, default=math.inf)
    record(name, same and error <= rtol, error, note=f"{count} local shards")


def run_checks(mesh):
    rng = np.random.default_rng(11)
    grads, specs = mixed_tree(rng)
    params, _ = mixed_tree(rng)

    def shard(tree):
        return jax.tree.map(lambda x, s: global_array(x, mesh, s), tree, specs)

    g, x = shard(grads), shard(params)
    values = {}

    norm_fn = jax.jit(optclip.global_norm, static_argnames="ord")
    for p in (2.0, 1.0, math.inf):
        norm = norm_fn(g, ord=p)
        values[f"global_norm/ord={p}"] = float(norm.addressable_data(0))
        check_shards(f"distributed/jit/global_norm/ord={p}", norm, ref_norm(grads, p))

    clipped, norm = jax.jit(optclip.clip_by_global_norm)(g, 1.0)
    want, want_norm = ref_clip(grads, 1.0)
    check_shards("distributed/jit/clip_by_global_norm/tree", clipped, want)
    check_shards("distributed/jit/clip_by_global_norm/norm", norm, want_norm)

    # The training step of the issue: optax.chain(global_clip, optimizer) under jit.
    opt = optax.chain(optclip.global_clip(1.0), optax.sgd(0.1, momentum=0.9))

    @jax.jit
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = opt.init(x)
    new_params, state = step(x, state, g)
    new_params, state = step(new_params, state, g)  # a second step: momentum and the count
    clipped_ref, _ = ref_clip(grads, 1.0)
    # sgd with momentum 0.9: after two equal gradients the parameters move by 0.1 * (1 + 1.9).
    want_params = jax.tree.map(lambda p, c: np.float64(p) - 0.1 * 2.9 * c, params, clipped_ref)
    check_shards("distributed/global_clip_step/params", new_params, want_params)
    step_norm = optax.tree.get(state, "global_norm")
    check_shards("distributed/global_clip_step/norm", step_norm, want_norm)
    values["global_clip_step/norm"] = float(step_norm.addressable_data(0))
    check_hlo("distributed/hlo/global_clip_step", step.lower(x, opt.init(x), g).compile().as_text())

    # shard_map with shard_map's own in_specs as axis_name, across the processes.
    sgd = optax.chain(optclip.global_clip(1.0, axis_name=specs), optax.sgd(0.1))

    def local_step(params, grads):
        updates, state = sgd.update(grads, sgd.init(params), params)
        return optax.apply_updates(params, updates), optax.tree.get(state, "global_norm")

    smap_step = jax.jit(
        jax.shard_map(local_step, mesh=mesh, in_specs=(specs, specs), out_specs=(specs, P()))
    )
    new_params, norm = smap_step(x, g)
    want_params, _ = ref_sgd_step(params, grads, 1.0, 0.1)
    check_shards("distributed/shard_map/params", new_params, want_params)
    check_shards("distributed/shard_map/norm", norm, want_norm)
    values["shard_map/norm"] = float(norm.addressable_data(0))

    # Per-leaf norms across the processes: under jit, and inside shard_map with the axes read
    # from how each leaf varies (axis_name=None).
    def group_norms(grads):
        tx = optclip.global_clip(1.0, group_norms="leaf")
        return tx.update(grads, tx.init(grads))[1].group_norms.values

    want_groups = ref_group_norms(grads, "leaf")
    check_shards("distributed/groups/jit", jax.jit(group_norms)(g), want_groups)
    smap_groups = jax.jit(jax.shard_map(group_norms, mesh=mesh, in_specs=(specs,), out_specs=P()))
    got = smap_groups(g)
    check_shards("distributed/groups/shard_map-auto", got, want_groups)
    values["groups"] = np.asarray(got.addressable_data(0)).tolist()
    return values


def ghost_checks():
    """`clipped_grad` (ghost clipping) over a global batch split over every process's devices
    along "data", each process placing its own examples, the parameters replicated: jitted
    with no mesh context under automatic sharding (multi-host data parallelism as it is
    usually written), and under `jax.set_mesh` with `spmd_axis_name` under explicit sharding.
    The norms and the clipped sums against the float64 reference of the whole batch."""
    import contextlib

    import ghost_models as gm
    from jax.sharding import AxisType

    cases = (("transformer", gm.transformer, AxisType.Auto), ("mlp", gm.mlp, AxisType.Explicit))
    for name, build, axis_type in cases:
        loss, params, x = build(np.random.default_rng(5), batch=2 * jax.device_count())
        norms, sums = gm.reference(loss, params, x, 1.0)
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(axis_type,))
        batch = global_array(np.asarray(x), mesh, P("data"))
        weights = jax.tree.map(lambda a, m=mesh: global_array(np.asarray(a), m, P()), params)
        explicit = axis_type == AxisType.Explicit
        g = optclip.clipped_grad(
            loss,
            l2_clip_norm=1.0,
            return_grad_norms=True,
            spmd_axis_name="data" if explicit else None,
        )
        with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
            grads, aux = jax.jit(g)(weights, batch)
        label = f"distributed/clipped_grad/{name}/{axis_type.name}"
        check_shards(f"{label}/norms", aux.grad_norms, norms)
        errors = [  # each leaf's shards within 1e-5 of its largest entry
            float(np.max(np.abs(np.asarray(s.data) - ref[s.index])) / np.max(np.abs(ref)))
            for leaf, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(sums), strict=True)
            for s in leaf.addressable_shards
        ]
        record(f"{label}/sums", max(errors) <= 1e-5, max(errors), note=f"{len(errors)} shards")


def main():
    process_id, num_processes, port = (int(a) for a in sys.argv[1:4])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as in tests/conftest.py
    compile_setting.follow_few_optimizations()  # (as the test processes compile)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    values = {}
    try:
        record(
            "distributed/topology",
            jax.process_count() == num_processes and jax.local_device_count() == 2,
            note=f"{jax.process_count()} processes, {jax.device_count()} devices",
        )
        mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
        with group("distributed"):
            values = run_checks(mesh)
        with group("distributed-ghost"):
            ghost_checks()
    finally:
        print("RESULT " + json.dumps({"results": RESULTS, "values": values}), flush=True)
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
