"""Run by `tests/test_ghost.py` in a process of its own with 8 CPU devices: `clipped_grad` on a
batch sharded over a data-parallel mesh (jit of sharded inputs; `spmd_axis_name` under the
mesh) equals the same call on one device. Prints ``ok`` and the checks made.

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
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import optclip

    cases = (
        # (model, mesh axis type): automatic sharding (GSPMD) for models with lookups (a
        # `gather` of a replicated table by split indices needs an explicit output sharding,
        # in any JAX code), and JAX's explicit sharding for the MLP
        ("transformer", gm.transformer, AxisType.Auto),
        ("tied", lambda rng, batch: gm.embedding(rng, batch=batch, tied=True), AxisType.Auto),
        ("mlp", gm.mlp, AxisType.Explicit),
    )
    assert jax.device_count() == 8, jax.devices()
    checks = []
    for name, build, axis_type in cases:
        mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
        loss, params, x = build(np.random.default_rng(0), batch=16)
        single = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
        expected = jax.jit(single)(params, x)
        sharded_x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
        replicated = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        split = optclip.clipped_grad(
            loss, l2_clip_norm=1.0, return_grad_norms=True, spmd_axis_name="data"
        )
        for label, fn in (("jit", single), ("spmd_axis_name", split)):
            with jax.set_mesh(mesh):
                got = jax.jit(fn)(replicated, sharded_x)
            for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
                e = np.asarray(e, np.float64)
                np.testing.assert_allclose(a, e, rtol=0, atol=1e-5 * np.max(np.abs(e)))
            checks.append(f"{name}/{axis_type.name}/{label}")
    print("ok", " ".join(checks))


if __name__ == "__main__":
    main()
