"""From PyTorch's `clip_grad_norm_` to `optclip.global_clip`.

A PyTorch training step clips between ``backward()`` and ``step()``::

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ...
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optimizer.step()

In Optax the clip is the first link of the optimizer, and the norm PyTorch returns is in the
optimizer state::

    optimizer = optax.chain(optclip.global_clip(1.0), optax.sgd(1e-2, momentum=0.9))
    ...
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    total_norm = optax.tree.get(opt_state, "global_norm")

The rest of ``torch.nn.utils``::

    clip_grad_norm_(ps, max_norm, norm_type=p)      optclip.global_clip(max_norm, ord=p)
    clip_grad_value_(ps, v)                         optclip.value_clip(v)
    get_total_norm(grads, norm_type=p)              optclip.global_norm(grads, ord=p)
    clip_grads_with_norm_(ps, max_norm, norm)       optclip.clip_by_global_norm(grads, max_norm,
                                                                                use_norm=norm)
    clip_grad_norm_(..., error_if_nonfinite=True)   no exception under jit: global_clip(...,
                                                    nonfinite="zero") or clipped(...,
                                                    nonfinite="skip") drop the step and count it

One difference, on purpose: PyTorch scales every gradient by
``min(1, max_norm / (total_norm + 1e-6))``; optclip scales by ``max_norm / total_norm`` when
``total_norm > max_norm`` and leaves the gradients untouched, bit for bit, otherwise. So

* optclip's clipped norm is ``max_norm`` (to float32 rounding); PyTorch's is
  ``max_norm * total_norm / (total_norm + 1e-6)``, short by a relative ``1e-6 / total_norm``:
  at float32 rounding level for large norms, 1e-4 for a norm of 0.01;
* a gradient whose norm is at (or within 1e-6 below) ``max_norm`` is scaled down slightly by
  PyTorch and left as it is by optclip.

This script shows that difference numerically, with PyTorch's formula restated in NumPy
(PyTorch itself is not needed), checks ``ord`` against PyTorch's ``norm_type``, and trains a
small network the PyTorch way. Run::

    python examples/from_pytorch.py [--steps N]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optclip

TORCH_EPS = 1e-6  # the constant in torch.nn.utils.clip_grad_norm_


def torch_total_norm(grads, norm_type=2.0):
    """`torch.nn.utils.get_total_norm` in NumPy: the norm of the per-tensor norms."""
    per_tensor = [np.linalg.norm(np.ravel(g), ord=norm_type) for g in grads]
    return np.float32(np.linalg.norm(np.array(per_tensor, np.float32), ord=norm_type))


def torch_clip_grad_norm(grads, max_norm, norm_type=2.0):
    """`torch.nn.utils.clip_grad_norm_` in NumPy (float32, as PyTorch computes it)."""
    total_norm = torch_total_norm(grads, norm_type)
    clip_coef = np.float32(max_norm) / (total_norm + np.float32(TORCH_EPS))
    clip_coef_clamped = np.minimum(clip_coef, np.float32(1.0))
    return [g * clip_coef_clamped for g in grads], total_norm


def compare_clipping():
    """PyTorch's and optclip's clipped norms, for gradients above, at and below `max_norm`."""
    cases = [
        ("norm 5 > max_norm 1", [[3.0, 4.0], [0.0]], 1.0),
        ("norm 0.05 > max_norm 0.01", [[0.03, 0.04], [0.0]], 0.01),
        ("norm 1 = max_norm 1", [[0.5, 0.5, 0.5], [0.5]], 1.0),
        ("norm 0.5 < max_norm 1", [[0.3, 0.4], [0.0]], 1.0),
    ]
    header = (
        f"{'case':<27} {'torch clipped norm':>19} {'optclip clipped norm':>21}"
        f" {'torch changed it':>17} {'optclip changed it':>19}"
    )
    print(header)
    print("-" * len(header))
    for name, values, max_norm in cases:
        grads = [np.array(v, np.float32) for v in values]
        torch_grads, _ = torch_clip_grad_norm(grads, max_norm)
        optclip_grads, _ = optclip.clip_by_global_norm([jnp.asarray(g) for g in grads], max_norm)
        optclip_grads = [np.asarray(g) for g in optclip_grads]
        torch_changed = any(not np.array_equal(a, b) for a, b in zip(grads, torch_grads))
        optclip_changed = any(not np.array_equal(a, b) for a, b in zip(grads, optclip_grads))
        print(
            f"{name:<27} {float(torch_total_norm(torch_grads)):>19.9g}"
            f" {float(torch_total_norm(optclip_grads)):>21.9g}"
            f" {str(torch_changed):>17} {str(optclip_changed):>19}"
        )


def compare_norm_types():
    """optclip's `ord` against PyTorch's `norm_type`."""
    grads = [np.array([[1.0, -2.0], [3.0, 0.5]], np.float32), np.array([-4.0, 0.25], np.float32)]
    print(f"\n{'norm_type / ord':<16} {'torch total norm':>17} {'optclip.global_norm':>20}")
    for order in (1.0, 2.0, 3.0, np.inf):
        ours = float(optclip.global_norm([jnp.asarray(g) for g in grads], ord=order))
        theirs = float(torch_total_norm(grads, order))
        print(f"{order:<16} {theirs:>17.7g} {ours:>20.7g}")
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def make_data(key, n=256):
    """Regression data from a random teacher network, with large targets (large gradients)."""
    key_x, key_teacher = jax.random.split(key)
    x = jax.random.normal(key_x, (n, 4))
    return x, 10.0 * predict(init_params(key_teacher), x)


def init_params(key):
    """A 4 -> 16 -> 1 tanh network (a `torch.nn.Sequential` of Linear, Tanh, Linear)."""
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


def train(steps):
    """The PyTorch training step above, in JAX; prints the loss and `total_norm`."""
    x, y = make_data(jax.random.key(42))
    optimizer = optax.chain(optclip.global_clip(1.0), optax.sgd(1e-2, momentum=0.9))
    params = init_params(jax.random.key(0))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)  # loss.backward()
        updates, opt_state = optimizer.update(grads, opt_state, params)  # clip + SGD
        return optax.apply_updates(params, updates), opt_state, loss  # optimizer.step()

    print(f"\ntraining with global_clip(1.0) + SGD, {steps} steps")
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state)
        if i % max(1, steps // 5) == 0 or i == steps - 1:
            total_norm = optax.tree.get(opt_state, "global_norm")
            print(f"  step {i:>4}  loss {float(loss):<9.4g} total_norm {float(total_norm):.4g}")
    clip_count = int(optax.tree.get(opt_state, "clip_count"))
    print(f"  {clip_count} of {steps} steps were clipped")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    compare_clipping()
    compare_norm_types()
    train(args.steps)


if __name__ == "__main__":
    main()
