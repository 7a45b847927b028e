"""Run by `tests/test_ghost.py` in a process of its own with 8 CPU devices: `clipped_grad` on a
batch sharded over a data-parallel mesh (jit of sharded inputs; `spmd_axis_name` under the
mesh; under automatic sharding also with no mesh context, the parameters replicated or split,
and with every weight held whole by a sharding constraint) equals the same call on one device,
on the common path and on the paths taken for gradients whose squares overflow and for a
dropped non-finite example, with the norms' Grams batched and one example at a time, with
every parameter scaled by a number the loss computes (a view of each weight), and by one
the step traces (an argument of the jitted step, passed to the loss unbatched); and
convolutions (grouped, a kernel used twice, stacked under a scan; kernels whose per-example
gradients are formed, the ``PRODUCT`` route). The transformer's common
path runs under every way of sharding, each of its other paths under the ways that meet it.
Prints ``ok`` and the checks made.

(Importing this module does nothing: JAX and the device count are set up in `main`.)
"""

import os
import sys


def main():
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    sys.path.insert(0, os.path.dirname(__file__))
    import ghost_models as gm
    import jax
    import numpy as np
    from _workers import compile_setting
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from optclip.per_example.ghost import _norms

    compile_setting.follow_few_optimizations()  # (as the test processes compile)

    loop_work = _norms.LOOP_WORK
    cases = (
        # (model, mesh axis type): automatic sharding (GSPMD) for models with lookups (a
        # `gather` of a replicated table by split indices needs an explicit output sharding,
        # in any JAX code), and JAX's explicit sharding for the MLP
        ("transformer", gm.transformer, AxisType.Auto),
        ("tied", lambda rng, batch: gm.embedding(rng, batch=batch, tied=True), AxisType.Auto),
        ("mlp", gm.mlp, AxisType.Explicit),
        # (kernels grouped, used twice, stacked under a scan: their sums written out on a CPU)
        ("conv", gm.conv_shared, AxisType.Auto),
        # (kernels whose per-example gradients the tapped pass forms: the PRODUCT route)
        ("product", gm.conv, AxisType.Auto),
        # (a GRU's state product reading pieces of its input product's tap, in a scan)
        ("gru", gm.gru, AxisType.Auto),
    )
    assert jax.device_count() == 8, jax.devices()
    root = lambda a: a * jax.numpy.sqrt(0.5)  # noqa: E731  (a number computed in the loss)
    checks = []
    for name, build, axis_type in cases:
        mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
        loss, params, x = build(np.random.default_rng(0), batch=16)
        # The common path; gradients whose squares overflow float32 (the norms' scaled path);
        # for the MLP, a non-finite example dropped and a padding example (the sums' zeroed
        # path).
        huge = lambda p, x, loss=loss: loss(p, x) * 1e20  # noqa: E731
        variants = [("", loss, x, None), ("huge", huge, x, None)]
        if name in ("conv", "product"):  # (the common path only: each variant compiles for 20 s)
            variants = [("", loss, x, None)]
        elif name not in (
            "tied",
            "gru",
        ):  # every parameter times a number the loss computes (muP's: its
            # weights are views, computed while tracing), or one the step traces
            scaled = lambda p, x, loss=loss: loss(jax.tree.map(root, p), x)  # noqa: E731
            variants.append(("scaled", scaled, x, None))
            traced = lambda p, x, s, loss=loss: loss(  # noqa: E731
                jax.tree.map(lambda a: a * s, p), x
            )
            variants.append(("traced", traced, x, None))
        if axis_type == AxisType.Auto and name not in (
            "conv",
            "product",
            "gru",
        ):  # one example at a
            variants.append(("looped", loss, x, None))  # time (a CPU's, for large Grams)
        if name == "transformer":  # every weight gathered whole in the loss, as FSDP code does
            whole = NamedSharding(mesh, PartitionSpec())
            held = lambda p, x, loss=loss, whole=whole: loss(  # noqa: E731
                jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, whole), p), x
            )
            variants.append(("held", held, x, None))
        if name == "mlp":
            padding = np.zeros(16, bool)
            padding[5] = True
            variants.append(("dropped", loss, x.at[3, 0].set(np.inf), padding))
        for variant, f, data, pad in variants:
            label = "/".join(filter(None, (name, axis_type.name, variant)))
            _norms.LOOP_WORK = 0 if variant == "looped" else loop_work
            number = (jax.numpy.float32(-0.75),) if variant == "traced" else ()
            only = TRANSFORMER_WAYS.get(variant) if name == "transformer" else None
            checks += compare(f, params, data, pad, mesh, label, number, only)
        _norms.LOOP_WORK = loop_work
    print("ok", " ".join(checks))


# The transformer's variants each under the ways of sharding that meet their path (its
# common path takes them all): its programs are the worker's slowest, about 5 s each.
TRANSFORMER_WAYS = {
    "huge": ("spmd_axis_name",),  # (the overflow-safe norms' scale, over every shard)
    "scaled": ("parameters split",),  # (a view of a weight that is split)
    "traced": ("parameters split",),
    "looped": ("jit", "spmd_axis_name"),  # (a loop over the examples of a split batch)
    "held": ("no mesh context", "parameters split"),  # (a split weight gathered whole)
}


def compare(loss, params, x, padding, mesh, label, number=(), only=None):
    """`clipped_grad` jitted over `x` split over the mesh (plain jit, `spmd_axis_name`, and
    under explicit sharding `method="vmap"` too; under automatic sharding, with no mesh
    context as well, the parameters replicated or split; of those, the names in `only`,
    if given) against the same call on one device; `number` the loss's arguments after the
    batch (neither batched nor differentiated: traced by the jitted step)."""
    import contextlib

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import optclip

    kwargs = {} if padding is None else {"is_padding_example": padding}
    single = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    expected = jax.jit(single)(params, x, *number, **kwargs)
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    sharded_x = jax.device_put(x, sharded)
    kwargs = {k: jax.device_put(v, sharded) for k, v in kwargs.items()}
    replicated = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    split = optclip.clipped_grad(
        loss, l2_clip_norm=1.0, return_grad_norms=True, spmd_axis_name="data"
    )
    # (name, function, under `jax.set_mesh`, parameters)
    contenders = [("jit", single, True, replicated), ("spmd_axis_name", split, True, replicated)]
    if mesh.axis_types[0] == AxisType.Explicit:  # the materialising reference too
        vmap = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True, method="vmap")
        contenders.append(("vmap", vmap, True, replicated))
    else:  # arrays placed on the mesh and jitted with no mesh context (the classic way), the
        # parameters replicated, or each split along its first axis that 8 divides (FSDP)
        def split_some(a):
            axes = [d for d, n in enumerate(a.shape) if n % 8 == 0]
            spec = PartitionSpec(*[None] * axes[0], "data") if axes else PartitionSpec()
            return jax.device_put(a, NamedSharding(mesh, spec))

        fsdp = jax.tree.map(split_some, params)
        contenders += [("no mesh context", single, False, replicated)]
        if any("data" in a.sharding.spec for a in jax.tree.leaves(fsdp)):
            contenders += [("parameters split", single, False, fsdp)]
    if only is not None:
        assert set(only) <= {c[0] for c in contenders}, (only, label)
        contenders = [c for c in contenders if c[0] in only]
    done = []
    for name, fn, in_context, weights in contenders:
        with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
            got = jax.jit(fn)(weights, sharded_x, *number, **kwargs)
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            e = np.asarray(e, np.float64)
            largest = np.max(np.abs(e[np.isfinite(e)]), initial=0)
            np.testing.assert_allclose(a, e, rtol=0, atol=1e-5 * largest)
        done.append(f"{label}/{name}")
    return done


if __name__ == "__main__":
    main()
