"""Records every public state of optclip, pickled, for tests/test_layout.py (states pickled by
an earlier layout of the package must still load).

    python tests/data/record_pickled_states.py

Recorded with optclip 0.1.0 as it was before its private modules moved into subpackages
(`optclip._transforms.GlobalClipState`, ...). Each state is taken after one update of a small
tree, its arrays as NumPy arrays so that the file does not depend on jax's own pickling.
"""

import pathlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip

TREE = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}


def after_one_update(transformation):
    state = transformation.init(TREE)
    _, state = transformation.update(TREE, state, TREE)
    return jax.tree.map(np.asarray, state)


def states():
    """One state per public transformation (the guards' states nested in `guarded`'s)."""
    guarded = optclip.guarded(
        optax.sgd(0.1),
        clip=optclip.global_clip(1.0),
        loss_scale=optclip.DynamicLossScale(),
        skip_spikes=optclip.SpikeSkip(),
        accumulation_steps=2,
    )
    return {
        "global_clip": after_one_update(optclip.global_clip(1.0)),
        "global_clip_schedule": after_one_update(optclip.global_clip(optax.constant_schedule(1.0))),
        "global_clip_groups": after_one_update(optclip.global_clip(1.0, group_norms="leaf")),
        "clipped": after_one_update(optclip.clipped(optax.sgd(0.1), global_clipnorm=1.0)),
        "guarded": after_one_update(guarded),
        "adagc": after_one_update(optclip.adagc()),
        "agc": after_one_update(optclip.agc(0.01)),
        "autoclip": after_one_update(optclip.autoclip()),
        "zclip": after_one_update(optclip.zclip()),
    }


if __name__ == "__main__":
    path = pathlib.Path(__file__).with_name("pickled_states.pkl")
    path.write_bytes(pickle.dumps(states(), protocol=4))
    print(path)
