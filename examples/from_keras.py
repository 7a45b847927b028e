"""From Keras' `clipnorm`, `clipvalue` and `global_clipnorm` to `optclip.clipped`.

Every Keras optimizer takes one of three clipping arguments::

    keras.optimizers.Adam(learning_rate=1e-2, clipnorm=1.0)         # each weight's gradient
    keras.optimizers.Adam(learning_rate=1e-2, clipvalue=0.5)        # each gradient element
    keras.optimizers.Adam(learning_rate=1e-2, global_clipnorm=1.0)  # all gradients together

``optclip.clipped`` gives any Optax optimizer the same three arguments, with the same meaning::

    optclip.clipped(optax.adam(1e-2), clipnorm=1.0)          # = chain(norm_clip(1.0), adam)
    optclip.clipped(optax.adam(1e-2), clipvalue=0.5)         # = chain(value_clip(0.5), adam)
    optclip.clipped(optax.adam(1e-2), global_clipnorm=1.0)   # = chain(global_clip(1.0), adam)

As in Keras, at most one of the three may be given. What Keras does not have:

* the gradient norm of the last step is in the optimizer state, for logging:
  ``optax.tree.get(opt_state, "global_norm")`` (with ``global_clipnorm``);
* ``nonfinite="skip"``: a step whose gradient holds NaN or inf changes nothing, neither the
  weights nor the optimizer's moments, and is counted in ``skip_count``.

This script trains a small network with each argument, checks that ``clipped(...)`` gives the
same weights as the explicit ``optax.chain``, and shows a skipped step. Run::

    python examples/from_keras.py [--steps N]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip

LEARNING_RATE = 1e-2

# Each Keras argument, as `clipped(...)` and as the chain it stands for.
KERAS_ARGUMENTS = {
    "clipnorm=1.0": (
        optclip.clipped(optax.adam(LEARNING_RATE), clipnorm=1.0),
        optax.chain(optclip.norm_clip(1.0), optax.adam(LEARNING_RATE)),
    ),
    "clipvalue=0.5": (
        optclip.clipped(optax.adam(LEARNING_RATE), clipvalue=0.5),
        optax.chain(optclip.value_clip(0.5), optax.adam(LEARNING_RATE)),
    ),
    "global_clipnorm=1.0": (
        optclip.clipped(optax.adam(LEARNING_RATE), global_clipnorm=1.0),
        optax.chain(optclip.global_clip(1.0), optax.adam(LEARNING_RATE)),
    ),
}


def make_data(key, n=256):
    """Regression data from a random teacher network, with large targets (large gradients)."""
    key_x, key_teacher = jax.random.split(key)
    x = jax.random.normal(key_x, (n, 4))
    return x, 10.0 * predict(init_params(key_teacher), x)


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


def fit(optimizer, data, steps):
    """What `model.fit` does, in Optax: the weights and optimizer state after `steps` steps."""
    x, y = data
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


def compare_with_chain(data, steps):
    """Train with each Keras argument both ways and print the losses."""
    header = f"{'Keras argument':<22} {'loss, clipped(...)':>19} {'max |weight diff| vs chain':>27}"
    print(header)
    print("-" * len(header))
    for name, (keras_style, chain) in KERAS_ARGUMENTS.items():
        params, opt_state = fit(keras_style, data, steps)
        params_chain, _ = fit(chain, data, steps)
        diff = largest_difference(params, params_chain)
        print(f"{name:<22} {float(loss_fn(params, *data)):>19.4g} {diff:>27.2g}")
        for leaf, leaf_chain in zip(jax.tree.leaves(params), jax.tree.leaves(params_chain)):
            np.testing.assert_allclose(leaf, leaf_chain, rtol=1e-5, atol=1e-6)
        if name.startswith("global_clipnorm"):
            last_norm = optax.tree.get(opt_state, "global_norm")
            print(
                f"{'':<22} gradient norm at the last step, from the state: {float(last_norm):.4g}"
            )


def show_skipped_step(data):
    """A NaN gradient with `nonfinite="skip"`: weights and Adam moments stay as they were."""
    x, y = data
    optimizer = optclip.clipped(optax.adam(LEARNING_RATE), global_clipnorm=1.0, nonfinite="skip")
    params = init_params(jax.random.key(0))
    opt_state = optimizer.init(params)
    update = jax.jit(optimizer.update)
    grads = jax.jit(jax.grad(loss_fn))(params, x, y)
    _, opt_state = update(grads, opt_state, params)  # one ordinary step
    bad_grads = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
    updates, new_state = update(bad_grads, opt_state, params)
    same_moments = all(
        bool(jnp.array_equal(a, b))
        for a, b in zip(
            jax.tree.leaves(opt_state.inner_state), jax.tree.leaves(new_state.inner_state)
        )
    )
    all_zero = all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    skipped = int(optax.tree.get(new_state, "skip_count"))
    print(
        f"\nnonfinite='skip', a gradient holding NaN: update all zeros: {all_zero}; "
        f"Adam state unchanged: {same_moments}; skip_count: {skipped}"
    )
    assert all_zero and same_moments and skipped == 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    data = make_data(jax.random.key(42))
    initial = float(loss_fn(init_params(jax.random.key(0)), *data))
    print(f"initial loss {initial:.4g}; {args.steps} Adam steps per run\n")
    compare_with_chain(data, args.steps)
    show_skipped_step(data)
    print("\nclipped(...) gives the same weights as the explicit chain")


if __name__ == "__main__":
    main()
