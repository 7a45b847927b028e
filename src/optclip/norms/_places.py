"""Where concrete arrays live, outside `jit`: the devices of each leaf, scales placed beside
the leaves they scale, and when a norm of concrete leaves runs as one compiled program."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec


def placement(x):
    """The devices of a concrete array committed to them (eager code), else None."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or not x.committed:
        return None
    return frozenset(x.sharding.device_set)


def on_devices_of(value, x):
    """The concrete `value` (a scale) placed on the devices of the concrete committed array `x`
    (replicated there), so that eager leaves on different devices are each scaled where they
    are."""
    where, here = placement(x), placement(value)
    if where is None or here is None or where == here:
        return value
    sharding = x.sharding
    target: jax.sharding.Sharding
    if len(where) == 1:
        target = jax.sharding.SingleDeviceSharding(next(iter(where)))
    elif isinstance(sharding, NamedSharding):
        target = NamedSharding(sharding.mesh, PartitionSpec())
    else:
        return value
    return jax.device_put(value, target)


def compiled_here(leaves) -> bool:
    """Whether a norm of concrete `leaves` is computed by the compiled program a `jit` would run.

    XLA fuses a square into the sum that consumes it (a fused multiply-add, rounded once),
    which an operation-by-operation evaluation cannot do: ``[48.69675, 48.69675, 64.93816]``
    has the norm 94.655754 jitted and 94.65576 eagerly. So concrete leaves go through the same
    program, compiled once per shape, and eager and jitted norms agree bit for bit. Leaves
    committed to different devices (which no single program takes) are reduced where they are.
    """
    if not leaves or any(isinstance(x, jax.core.Tracer) for x in leaves):
        return False
    return len({placement(x) for x in leaves} - {None}) <= 1
