"""From TensorFlow's "compute, clip, apply" to optclip.

In TensorFlow 1 you clip by splitting ``minimize()`` into its three steps::

    optimizer = tf.train.AdamOptimizer(1e-3)
    gradients, variables = zip(*optimizer.compute_gradients(loss))   # 1. compute
    gradients, _ = tf.clip_by_global_norm(gradients, 5.0)             # 2. clip
    train_op = optimizer.apply_gradients(zip(gradients, variables))   # 3. apply

and in TensorFlow 2 a tape computes the gradients::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    gradients = tape.gradient(loss, model.trainable_variables)
    gradients, _ = tf.clip_by_global_norm(gradients, 5.0)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))

In JAX and Optax the three steps are already separate, so the TensorFlow code carries over
line by line (form 1). Or the clip becomes part of the optimizer (form 2), and the training
step no longer mentions it::

    # form 1: compute, clip, apply
    grads = jax.grad(loss_fn)(params)
    grads, norm = optclip.clip_by_global_norm(grads, 5.0)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

    # form 2: the clip is the first link of the optimizer
    optimizer = optax.chain(optclip.global_clip(5.0), optax.adam(1e-3))
    norm = optax.tree.get(opt_state, "global_norm")   # the norm, for logging

The per-tensor modes map the same way (TensorFlow, then the optclip function, then the
optclip transformation)::

    [tf.clip_by_value(g, -1., 1.) for g in grads]
        optclip.clip_by_value(grads, -1., 1.)          optclip.value_clip(1.0)
    [tf.clip_by_norm(g, 5.0) for g in grads]
        optclip.clip_by_norm(grads, 5.0)               optclip.norm_clip(5.0)
    [tf.clip_by_average_norm(g, 0.1) for g in grads]
        optclip.clip_by_average_norm(grads, 0.1)       optclip.average_norm_clip(0.1)
    tf.clip_by_global_norm(grads, 5.0)
        optclip.clip_by_global_norm(grads, 5.0)        optclip.global_clip(5.0)
    tf.global_norm(grads)
        optclip.global_norm(grads)

This script trains a small network both ways for each mode and checks that the two forms give
the same weights. Run::

    python examples/from_tensorflow.py [--steps N]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip

LEARNING_RATE = 1e-2
# The per-mode thresholds, chosen small enough that clipping is active in most steps.
VALUE = 0.5
NORM = 1.0
GLOBAL_NORM = 1.0


def make_data(key, n=256):
    """Regression data from a random teacher network, with large targets (large gradients)."""
    key_x, key_teacher = jax.random.split(key)
    x = jax.random.normal(key_x, (n, 4))
    teacher = init_params(key_teacher)
    return x, 10.0 * predict(teacher, x)


def init_params(key):
    """A 4 -> 16 -> 1 tanh network."""
    key_1, key_2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(key_1, (4, 16)) / 2.0,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(key_2, (16, 1)) / 4.0,
        "b2": jnp.zeros(1),
    }


def predict(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


# Form 1: compute, clip, apply. `clip` is a function of the gradient tree, like the
# list comprehension in the TensorFlow code.
FUNCTIONS = {
    "clip_by_value": lambda grads: optclip.clip_by_value(grads, -VALUE, VALUE),
    "clip_by_norm": lambda grads: optclip.clip_by_norm(grads, NORM),
    "clip_by_global_norm": lambda grads: optclip.clip_by_global_norm(grads, GLOBAL_NORM)[0],
}

# Form 2: the same clip as the first transformation of the optimizer.
TRANSFORMS = {
    "clip_by_value": optclip.value_clip(VALUE),
    "clip_by_norm": optclip.norm_clip(NORM),
    "clip_by_global_norm": optclip.global_clip(GLOBAL_NORM),
}


def train_compute_clip_apply(clip, data, steps):
    """Form 1: the TensorFlow pattern, step by step."""
    x, y = data
    optimizer = optax.adam(LEARNING_RATE)
    params = init_params(jax.random.key(0))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params, x, y)  # 1. compute
        grads = clip(grads)  # 2. clip
        updates, opt_state = optimizer.update(grads, opt_state, params)  # 3. apply
        return optax.apply_updates(params, updates), opt_state

    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return params


def train_clip_in_optimizer(clip_transform, data, steps):
    """Form 2: `optax.chain(clip, adam)`; the step has no clipping code."""
    x, y = data
    optimizer = optax.chain(clip_transform, optax.adam(LEARNING_RATE))
    params = init_params(jax.random.key(0))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return params, opt_state


def largest_difference(tree_a, tree_b):
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), tree_a, tree_b)
    return max(jax.tree.leaves(diffs))


def show_norm_in_state(data):
    """`clip_by_global_norm` returns the norm; `global_clip` keeps the same number in its state."""
    x, y = data
    params = init_params(jax.random.key(0))
    grads = jax.jit(jax.grad(loss_fn))(params, x, y)
    _, norm = jax.jit(optclip.clip_by_global_norm)(grads, GLOBAL_NORM)
    optimizer = optax.chain(optclip.global_clip(GLOBAL_NORM), optax.adam(LEARNING_RATE))
    _, opt_state = jax.jit(optimizer.update)(grads, optimizer.init(params), params)
    in_state = optax.tree.get(opt_state, "global_norm")
    print(
        f"\nglobal norm of the first gradient: clip_by_global_norm returns {float(norm):.6g}, "
        f"optax.tree.get(opt_state, 'global_norm') reads {float(in_state):.6g}"
    )
    np.testing.assert_allclose(float(norm), float(in_state), rtol=1e-6)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    data = make_data(jax.random.key(42))
    initial = float(loss_fn(init_params(jax.random.key(0)), *data))
    print(f"initial loss {initial:.4g}; {args.steps} Adam steps per run\n")
    header = (
        f"{'TensorFlow op':<22} {'loss, form 1':>13} {'loss, form 2':>13} {'max |weight diff|':>18}"
    )
    print(header)
    print("-" * len(header))
    for name in FUNCTIONS:
        params_1 = train_compute_clip_apply(FUNCTIONS[name], data, args.steps)
        params_2, _ = train_clip_in_optimizer(TRANSFORMS[name], data, args.steps)
        diff = largest_difference(params_1, params_2)
        print(
            f"{'tf.' + name:<22} {float(loss_fn(params_1, *data)):>13.4g} "
            f"{float(loss_fn(params_2, *data)):>13.4g} {diff:>18.2g}"
        )
        for leaf_1, leaf_2 in zip(jax.tree.leaves(params_1), jax.tree.leaves(params_2)):
            np.testing.assert_allclose(leaf_1, leaf_2, rtol=1e-5, atol=1e-6)
    show_norm_in_state(data)
    print("\nboth forms give the same weights")


if __name__ == "__main__":
    main()
