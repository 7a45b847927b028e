"""`optclip.clipped_grad` side by side with `jax_privacy.clipped_grad` (2.0) on the same calls:
the same outputs (structure, values within float32 rounding) for every argument they share,
and the differences on purpose (a non-finite example, norms whose squares overflow)."""

import ghost_models as gm
import jax
import jax.numpy as jnp
import jax_privacy  # (the test extra installs it: these tests never skip)
import numpy as np
import pytest

import optclip


def pair(loss, method="auto", **kwargs):
    """A function returning the results of the same call through jax_privacy and optclip."""
    theirs = jax_privacy.clipped_grad(loss, **kwargs)
    ours = optclip.clipped_grad(loss, method=method, **kwargs).fun
    return lambda *a, **k: (theirs(*a, **k), ours(*a, **k))


def both(loss, *args, method="auto", call_kwargs=None, **kwargs):
    """`pair`'s results, from one jitted program (jax_privacy's run eagerly would compile one
    program per operation)."""
    return jax.jit(pair(loss, method, **kwargs))(*args, **(call_kwargs or {}))


def assert_same(theirs, ours, rtol=2e-5):
    # (their `Aux` and our `AuxiliaryOutput` are namedtuples of the same fields)
    if isinstance(theirs, tuple) and len(theirs) == 2 and hasattr(theirs[1], "_fields"):
        assert theirs[1]._fields == ours[1]._fields
        theirs, ours = (theirs[0], tuple(theirs[1])), (ours[0], tuple(ours[1]))
    assert jax.tree.structure(theirs) == jax.tree.structure(ours)
    for a, b in zip(jax.tree.leaves(theirs), jax.tree.leaves(ours), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=0, atol=rtol * max(np.max(np.abs(a)), 1e-30))


CASES = {
    "default": {},
    "outputs": {"return_values": True, "return_grad_norms": True},
    "rescale": {"rescale_to_unit_norm": True, "normalize_by": 4.0},
    "no clip": {"l2_clip_norm": jnp.inf},
    "zero clip": {"l2_clip_norm": 0.0},
    "microbatches": {"microbatch_size": 2, "return_grad_norms": True},
    "dtype": {"dtype": jnp.float32},
    # a per-example transform needs the per-example gradients: "auto" runs as "vmap"
    "transform": {"pre_clipping_transform": lambda g: jax.tree.map(lambda x: 3 * x, g)},
}


@pytest.mark.parametrize("method", ["auto", "vmap"])
@pytest.mark.parametrize("case", list(CASES))
def test_same_results_as_jax_privacy(case, method):
    loss, params, ids = gm.embedding(np.random.default_rng(0), tied=True)
    kwargs = {"l2_clip_norm": 0.5, **CASES[case]}
    theirs, ours = both(loss, params, ids, method=method, **kwargs)
    assert_same(theirs, ours)


@pytest.mark.parametrize("method", ["auto", "vmap"])
@pytest.mark.parametrize("case", ["default", "outputs", "rescale"])
def test_the_gradient_through_the_clip_as_jax_privacy(case, method):
    """`jax.grad` of a function of the clipped sum (and of the norms): jax_privacy
    differentiates through each example's clip factor; so does optclip (the ghost way held
    the factors fixed, a different gradient)."""
    loss, params, ids = gm.embedding(np.random.default_rng(1), tied=True)
    kwargs = {"l2_clip_norm": 0.5, **CASES[case]}

    def through(clipped):
        def objective(p):
            out = clipped(p, ids)
            sums, aux = out if isinstance(out, tuple) else (out, None)
            total = sum(jnp.sum(jnp.sin(g)) for g in jax.tree.leaves(sums))
            if aux is not None and aux.grad_norms is not None:
                total = total + jnp.sum(jnp.sqrt(aux.grad_norms + 1.0))
            return total

        return jax.value_and_grad(objective)(params)

    theirs, ours = jax.jit(
        lambda: (
            through(jax_privacy.clipped_grad(loss, **kwargs)),
            through(optclip.clipped_grad(loss, method=method, **kwargs)),
        )
    )()
    assert_same(theirs, ours, rtol=1e-5)


@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_aux_keys_padding_and_argnums_as_jax_privacy(method):
    rng = np.random.default_rng(1)
    loss, params, x = gm.mlp(rng)
    labels = jnp.asarray(rng.normal(size=(x.shape[0], 3)), jnp.float32)

    def noisy(w1, rest, key, x, y):  # two differentiated arguments, a key, two batch ones
        p = {"w1": w1, **rest}
        noise = jax.random.normal(key, x.shape, x.dtype) * 0.1
        value = loss(p, x + noise) + jnp.sum(y)
        return value, {"first": x[:, 0], "label": y}

    padding = jnp.array([False, True, False, False, True, False])
    rest = {k: v for k, v in params.items() if k != "w1"}
    key = jax.random.key(3)
    theirs, ours = both(
        noisy,
        params["w1"],
        rest,
        key,
        x,
        labels,
        method=method,
        argnums=(0, 1),
        batch_argnums=(3, 4),
        prng_argnum=2,
        has_aux=True,
        return_grad_norms=True,
        l2_clip_norm=1.0,
        call_kwargs={"is_padding_example": padding},
    )
    assert_same(theirs, ours)
    assert ours[1].aux["first"].shape == (6,)  # the size-1 example axis squeezed, as theirs


def test_per_user_groups_without_the_batch_dim():
    # jax_privacy's own example: keep_batch_dim=False, each "example" a user's rows.
    f = lambda param, data: 0.5 * jnp.mean((data - param) ** 2)  # noqa: E731
    users = jnp.array([[1.0, -1.0], [2.0, 2.0], [0.0, 3.0]])
    kwargs = {"l2_clip_norm": jnp.inf, "keep_batch_dim": False}
    theirs, *ours = jax.jit(  # (one program: theirs, and ours by each method)
        lambda p, d: (
            [jax_privacy.clipped_grad(f, **kwargs)(p, d)]
            + [optclip.clipped_grad(f, method=m, **kwargs).fun(p, d) for m in ("auto", "vmap")]
        )
    )(3.0, users)
    for by_method in ours:
        assert_same(theirs, by_method)
        assert float(by_method) == 5.5


def test_differences_on_purpose():
    loss, params, x = gm.mlp(np.random.default_rng(2))
    # A non-finite example: jax_privacy zeroes its non-finite entries and keeps the rest;
    # optclip drops the example.
    bad = x.at[0, 0].set(jnp.inf)
    kwargs = {"l2_clip_norm": 1.0, "return_grad_norms": True}
    big = lambda p, x: loss(p, x) * 1e25  # noqa: E731
    (theirs, ours), (theirs_big, ours_big) = jax.jit(  # (both cases in one program)
        lambda p, bad, x: (pair(loss, **kwargs)(p, bad), pair(big, **kwargs)(p, x))
    )(params, bad, x)
    assert not np.isfinite(ours[1].grad_norms[0])
    _, sums = gm.reference(loss, params, x, 1.0, np.arange(6) == 0)
    for k in sums:
        np.testing.assert_allclose(ours[0][k], sums[k], atol=2e-5 * np.max(np.abs(sums[k])))
    assert not all(np.allclose(theirs[0][k], sums[k], rtol=1e-4) for k in sums)
    # Gradients whose squares overflow float32: jax_privacy's norm is inf (the example is
    # zeroed), optclip's is exact (the example is clipped).
    assert np.all(np.isinf(theirs_big[1].grad_norms))
    norms, sums = gm.reference(big, params, x, 1.0)
    np.testing.assert_allclose(ours_big[1].grad_norms, norms, rtol=1e-5)
