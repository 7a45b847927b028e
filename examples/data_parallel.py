"""Clipping by the global norm on a mesh of devices: data-parallel and sharded (FSDP) training.

A small MLP is trained on a mesh of 8 devices, with ``optclip.global_clip`` in the optimizer
chain, four ways that must (and do) give the same training as one device:

1. one device: the reference;
2. data-parallel under ``jit``: the batch split over the ``"data"`` axis, the parameters
   replicated. Nothing in the clipping changes: the gradients are whole arrays;
3. FSDP under ``jit``: the parameters, the gradients and Adam's moments split over ``"data"``
   too (each weight matrix by rows; the last bias, of size 1, replicated). Still no code change:
   the norm of a sharded array is reduced on every device and all-reduced as a scalar, never
   gathered;
4. FSDP written with ``shard_map``: the code sees per-device pieces, so ``global_clip`` is told
   which axes each parameter is split over, ``axis_name=PARAM_SPECS`` (the same tree as
   shard_map's ``in_specs``). A replicated leaf is counted once and a sharded one across its
   shards. Without it, each device would clip by the norm of its own piece (optax's
   ``clip_by_global_norm`` does that inside ``shard_map``).

The norm and the clip count are read from the optimizer state (``optax.tree.get``), never
computed again. Run::

    python examples/data_parallel.py [--steps N]

On CPU the script asks XLA for 8 host devices (``--xla_force_host_platform_device_count=8``,
set before JAX starts). On GPUs or TPUs the same code runs unchanged on the real devices: the
mesh ``jax.make_mesh((jax.device_count(),), ("data",))`` takes all of them (here their number
must divide 16, the smallest dimension split), and the flag only concerns the CPU. On several
hosts, call ``jax.distributed.initialize()`` first on every host
(with ``coordinator_address``, ``num_processes`` and ``process_id`` where the cluster is not
detected), build the global batch with ``jax.make_array_from_process_local_data`` from each
host's part, and run the same ``jit`` step: the mesh then spans every host's devices and the
norm's scalar all-reduce crosses hosts like any other collective. ``tests/_workers/
distributed.py`` clips that way in two processes of 2 CPU devices each and checks every process
against the float64 reference of the global data.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402  (JAX must see XLA_FLAGS first)
import contextlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, reshard  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import optclip  # noqa: E402

SIZES = (16, 64, 64, 1)
BATCH = 128  # global batch: 16 examples per device on 8 devices
MAX_NORM = 1.0
LEARNING_RATE = 1e-2

# How FSDP splits each parameter over the "data" axis: matrices by rows, biases along their
# length, and the output bias (size 1) replicated.
PARAM_SPECS = [
    {"w": P("data", None), "b": P("data")},
    {"w": P("data", None), "b": P("data")},
    {"w": P("data", None), "b": P()},
]
REPLICATED = jax.tree.map(lambda _: P(), PARAM_SPECS)
OPTIMIZER = optax.chain(optclip.global_clip(MAX_NORM), optax.adam(LEARNING_RATE))


def init_params(key):
    params = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        key, sub = jax.random.split(key)
        params.append(
            {"w": jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros((n_out,))}
        )
    return params


def predict(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def make_batches(key, steps):
    """Regression batches from a random teacher, scaled up so that early gradients are large."""
    teacher = init_params(jax.random.fold_in(key, 1))
    x = jax.random.normal(key, (steps, BATCH, SIZES[0]))
    return x, 5.0 * jax.vmap(predict, (None, 0))(teacher, x)


# ----------------------------------------------------------------------------------------------
# The jit steps: the same code for one device, data-parallel and FSDP; only the shardings of
# the inputs differ.


def gathered(params):
    """FSDP's all-gather of the weights before they are used (a no-op on replicated ones)."""

    def gather(p):
        split = any(axis is not None for axis in jax.typeof(p).sharding.spec)
        return reshard(p, P()) if split else p

    return jax.tree.map(gather, params)


@jax.jit
def jit_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(gathered(p), x, y))(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# ----------------------------------------------------------------------------------------------
# The shard_map step: per-device code, so the collectives and `axis_name` are explicit.


def shard_map_step(mesh):
    n_devices = mesh.shape["data"]
    optimizer = optax.chain(
        optclip.global_clip(MAX_NORM, axis_name=PARAM_SPECS), optax.adam(LEARNING_RATE)
    )

    def local_step(params, opt_state, x, y):
        def local_loss(params):
            # All-gather each sharded weight; its gradient comes back reduce-scattered.
            full = jax.tree.map(
                lambda p, s: p if s == P() else jax.lax.all_gather(p, "data", tiled=True),
                params,
                PARAM_SPECS,
            )
            return loss_fn(full, x, y)

        loss, grads = jax.value_and_grad(local_loss)(params)
        # Each device's loss is the mean over its own examples, and the gradients come back
        # summed over the devices: divided by their number, the gradient of the global mean.
        grads = jax.tree.map(lambda g: g / n_devices, grads)
        loss = jax.lax.pmean(loss, "data")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def step(params, opt_state, x, y):
        # Adam's moments are split like the parameters; the counters and the norm replicated.
        state_specs = optax.tree_map_params(
            optimizer,
            lambda _, spec: spec,
            opt_state,
            PARAM_SPECS,
            transform_non_params=lambda _: P(),
        )
        return jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(PARAM_SPECS, state_specs, P("data"), P("data")),
            out_specs=(PARAM_SPECS, state_specs, P()),
        )(params, opt_state, x, y)

    return optimizer, jax.jit(step)


# ----------------------------------------------------------------------------------------------


def train(name, step, optimizer, params, batches, mesh, param_specs, log_every):
    """Runs the steps on `mesh` (None: one device), logging the gradient norm and the clip count
    from the optimizer state."""

    def put(tree, specs):
        if mesh is None:
            return jax.device_put(tree, jax.devices()[0])
        return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    params = put(params, param_specs)
    opt_state = optimizer.init(params)
    xs, ys = batches
    norms = []
    start = time.perf_counter()
    for i in range(xs.shape[0]):
        x, y = put(xs[i], P("data")), put(ys[i], P("data"))  # the batch split over "data"
        params, opt_state, loss = step(params, opt_state, x, y)
        norm = float(optax.tree.get(opt_state, "global_norm"))  # logged from the state
        norms.append(norm)
        if i % log_every == 0 or i == xs.shape[0] - 1:
            clips = int(optax.tree.get(opt_state, "clip_count"))
            print(
                f"  {name:<20} step {i:>4}  loss {float(loss):9.4f}  grad norm {norm:9.4f}"
                f"  clipped so far {clips}"
            )
    print(f"  {name:<20} {time.perf_counter() - start:.1f} s")
    return params, np.array(norms)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    args = parser.parse_args(argv)

    # All the devices (8 CPU devices here), with explicit axis types, JAX's default.
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    print(
        f"{jax.device_count()} devices; mesh {dict(mesh.shape)}; global batch {BATCH}; "
        f"{args.steps} steps of chain(global_clip({MAX_NORM}), adam)\n"
    )
    params = init_params(jax.random.key(0))
    batches = make_batches(jax.random.key(1), args.steps)
    log_every = max(args.steps // 5, 1)

    smap_optimizer, smap_step = shard_map_step(mesh)
    runs = {  # step, optimizer, mesh, how the parameters are split
        "one device": (jit_step, OPTIMIZER, None, None),
        "data-parallel (jit)": (jit_step, OPTIMIZER, mesh, REPLICATED),
        "FSDP (jit)": (jit_step, OPTIMIZER, mesh, PARAM_SPECS),
        "FSDP (shard_map)": (smap_step, smap_optimizer, mesh, PARAM_SPECS),
    }
    results = {}
    for name, (step, optimizer, run_mesh, specs) in runs.items():
        # `set_mesh`: the mesh that `reshard(p, P())` refers to; the one-device run has none.
        with contextlib.nullcontext() if run_mesh is None else jax.set_mesh(run_mesh):
            results[name] = train(
                name, step, optimizer, params, batches, run_mesh, specs, log_every
            )
        print()

    reference_params, reference_norms = results["one device"]
    print(
        f"{'setting':<20} {'max rel. diff of grad norms':>28} {'max |param diff|':>17}  "
        f"sharding of the first weight"
    )
    for name, (final, norms) in results.items():
        norm_diff = np.max(np.abs(norms - reference_norms) / reference_norms)
        param_diff = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(reference_params))
        )
        print(
            f"{name:<20} {norm_diff:>28.2g} {param_diff:>17.2g}  "
            f"{getattr(final[0]['w'].sharding, 'spec', 'one device')}"
        )
        # float32 sums in another order: the same to rounding, drifting slowly with Adam.
        assert norm_diff < 1e-4 and param_diff < 1e-4, name
    print("\nevery setting clips by the same global norm as one device")


if __name__ == "__main__":
    main()
