"""An eager call of `clipped_grad` runs as one compiled program (`ghost/_eager.py`): compiled
once for its shapes, and what the loss closes over read at every call, as eagerly."""

import functools
import gc
import logging
import weakref

import ghost_models as gm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ghost_models import RTOL, assert_tree_close

import optclip
from optclip.per_example.ghost import _eager


@pytest.fixture
def compiles(caplog):
    """The names of the programs JAX compiles inside ``with compiles() as names:``."""

    class Recorder:
        def __enter__(self):
            caplog.clear()
            self.log = jax.log_compiles(True)
            self.log.__enter__()
            self.names = []
            return self.names

        def __exit__(self, *exc):
            self.log.__exit__(*exc)
            for record in caplog.records:
                message = record.getMessage()
                if message.startswith("Compiling "):
                    self.names.append(message.split(" ")[1])

    caplog.set_level(logging.DEBUG, logger="jax")
    return Recorder


def check(out, loss, params, x, clip):
    grads, aux = out
    norms, sums = gm.reference(loss, params, x, clip)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL)
    assert_tree_close(grads, sums)


@pytest.mark.usefixtures("as_users_compile")  # (eager and jitted: the same bits)
@pytest.mark.parametrize("method", ["auto", "vmap"])
def test_an_eager_call_compiles_one_program_once_for_its_shapes(method, compiles):
    # Before, the MLP's first eager call compiled each of the engine's operations on its own:
    # 189 compilations (docs/design/ghost-costs.md, "An eager call").
    loss, params, x = gm.mlp(np.random.default_rng(80))
    g = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True, method=method)
    with compiles() as first:
        out = g(params, x)
    check(out, loss, params, x, 0.5)
    assert first.count("jit(program)") == 1, first
    assert len(first) <= 8, first  # (the program; the inputs' conversions, the padding's zeros)
    with compiles() as again:
        out = g(params, x)
    check(out, loss, params, x, 0.5)
    assert again == []
    jitted = jax.jit(g)(params, x)  # (eager and jitted: the same bits)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(a, b)
    smaller = x[:3]
    with compiles() as other:
        out = g(params, smaller)
    check(out, loss, params, smaller, 0.5)
    assert other.count("jit(program)") == 1, other


def test_an_eager_call_reads_what_its_loss_closes_over_at_each_call(compiles):
    """A global array (passed to the program), a global scalar (read by the ghost analysis: a
    new program for a new value) and a Python flag (a new jaxpr): each call's values, against
    the float64 reference with those values. A cached `jax.jit` of the call would keep the
    first ones."""
    rng = np.random.default_rng(81)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    held = {"table": jnp.ones((3,)), "gain": jnp.float32(1.0), "square": True}

    def loss(p, x):
        y = (x @ (p["w"] * held["gain"])) * held["table"]
        return jnp.sum(y**2) if held["square"] else jnp.sum(jnp.sin(y))

    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    check(g(params, x), loss, params, x, 1.0)
    held["table"] = jnp.asarray(rng.normal(size=(3,)), jnp.float32)
    with compiles() as names:
        out = g(params, x)
    check(out, loss, params, x, 1.0)
    assert "jit(program)" not in names  # (the same program, given the new table)
    held["gain"] = jnp.float32(-3.0)
    report = optclip.ghost_report(loss, params, x)["['w']"]
    assert report.mode == "ghost", report
    with compiles() as names:
        out = g(params, x)
    check(out, loss, params, x, 1.0)
    assert names.count("jit(program)") == 1  # (the ghost norm's scale is the number's)
    held["square"] = False
    check(g(params, x), loss, params, x, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reversed_gradient(h, coefficient):
    """A gradient reversal layer (the identity, its gradient times ``-coefficient``): the
    coefficient, a Python number, reaches only the backward rule, not the loss's jaxpr."""
    return h


reversed_gradient.defvjp(lambda h, c: (h, None), lambda c, _, g: (-c * g,))


@pytest.mark.parametrize("kind", ["float", "int", "bool"])
def test_a_python_number_among_the_arguments_is_each_calls(kind, compiles):
    # A number passed to a gradient reversal layer through the loss's arguments: the loss's
    # jaxpr is the same for every value, its gradient is not. Each call must take its own
    # number (the first eager programs were keyed on the jaxpr: the next value got the first
    # value's gradients); the program compiled for a number is kept for it.
    rng = np.random.default_rng(82)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    values = {"float": (0.5, 2.0, -0.0, 0.5), "int": (1, 3, 1), "bool": (True, False, True)}

    def loss(p, x, coefficient):
        return jnp.sum(jnp.sin(reversed_gradient(x @ p["w"], coefficient)))

    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    seen = set()
    for value in values[kind]:
        with compiles() as names:
            out = g(params, x, value)
        assert names.count("jit(program)") == (repr(value) not in seen), (value, names)
        seen.add(repr(value))
        check(out, lambda p, x, value=value: loss(p, x, value), params, x, 1.0)
        jitted = jax.jit(g, static_argnums=2)(params, x, value)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(jitted), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_rule_reads_what_is_outside_the_loss_when_its_program_compiles(compiles):
    # What the docstring says: a custom derivative rule is the compiling call's, as under
    # `jax.jit`. A coefficient the rule reads from a global, changed between calls, is not
    # seen by the kept program (as a jitted step would not see it); given among the
    # arguments it is (`test_a_python_number_among_the_arguments_is_each_calls`).
    rng = np.random.default_rng(83)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    held = {"coefficient": 0.5}

    @jax.custom_vjp
    def reverse(h):
        return h

    reverse.defvjp(lambda h: (h, None), lambda _, g: (-held["coefficient"] * g,))

    def loss(p, x):
        return jnp.sum(jnp.sin(reverse(x @ p["w"])))

    g = optclip.clipped_grad(loss, l2_clip_norm=1e30, return_grad_norms=True)
    jitted = jax.jit(g)
    first, first_jitted = g(params, x), jitted(params, x)
    held["coefficient"] = 2.0
    with compiles() as names:
        again, again_jitted = g(params, x), jitted(params, x)
    assert names == []
    for a, b, c, d in zip(*map(jax.tree.leaves, (first, again, first_jitted, again_jitted))):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(c, d)
        np.testing.assert_array_equal(a, c)
    fresh = optclip.clipped_grad(loss, l2_clip_norm=1e30, return_grad_norms=True)
    check(fresh(params, x), loss, params, x, 1e30)  # (a new function compiles anew: 2.0)
    np.testing.assert_allclose(fresh(params, x)[1].grad_norms, 4 * first[1].grad_norms, rtol=1e-6)


def test_a_kept_program_keeps_no_array_of_its_call_alive():
    """The parameters, the batch and an array the loss closed over are freed once the caller
    drops them: the kept program holds none of them."""
    rng = np.random.default_rng(85)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    held = {"table": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
    loss = lambda p, x: jnp.sum((x @ p["w"]) * held["table"]) ** 2  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    jax.block_until_ready(g(params, x))
    refs = [weakref.ref(a) for a in (params["w"], x, held["table"])]
    del params, x
    held.clear()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_a_program_for_each_of_the_last_calls_is_kept(compiles, monkeypatch):
    """A Python number among the arguments is written into the loss's jaxpr: each number its
    own program, the `_eager.LIMIT` latest kept (eight, as the docstring says)."""
    assert _eager.LIMIT == 8
    monkeypatch.setattr(_eager, "LIMIT", 2)
    rng = np.random.default_rng(82)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    loss = lambda p, x, c: jnp.sum((x @ p["w"]) ** 2) * c  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, return_grad_norms=True)
    for c in (1.0, 2.0, 3.0):
        with compiles() as names:
            out = g(params, x, c)
        check(out, lambda p, x, c=c: loss(p, x, c), params, x, 1.0)
        assert names.count("jit(program)") == 1
    with compiles() as names:
        g(params, x, 3.0), g(params, x, 2.0)
    assert "jit(program)" not in names
    with compiles() as names:
        out = g(params, x, 1.0)
    check(out, lambda p, x: loss(p, x, 1.0), params, x, 1.0)
    assert names.count("jit(program)") == 1


@pytest.mark.slow  # (every operation of the engine compiled on its own: about 300 programs)
def test_under_disable_jit_the_engine_runs_operation_by_operation():
    """Under `jax.disable_jit` the engine's operations run one by one (its `lax.cond`s choose
    in Python), with the float64 reference's results."""
    loss, params, x = gm.mlp(np.random.default_rng(83))
    g = optclip.clipped_grad(loss, l2_clip_norm=0.5, return_grad_norms=True)
    with jax.disable_jit():
        check(g(params, x), loss, params, x, 0.5)


def test_inside_a_callers_trace_the_engine_runs_in_that_trace():
    """A loss that closes over a number traced by the caller (its arguments concrete
    constants) runs in the caller's trace, with the float64 reference's results."""
    loss, params, x = gm.mlp(np.random.default_rng(83))

    def step(s):
        scaled = lambda p, x: loss(p, x) * s  # noqa: E731
        return optclip.clipped_grad(scaled, l2_clip_norm=0.5, return_grad_norms=True)(params, x)

    check(jax.jit(step)(jnp.float32(2.0)), lambda p, x: loss(p, x) * 2.0, params, x, 0.5)


def test_a_pre_clipping_transform_reads_what_it_closes_over_at_each_call():
    """`pre_clipping_transform` is not compiled into a kept program: a transform that closes
    over an array sees its value at each call."""
    loss, params, x = gm.mlp(np.random.default_rng(84))
    held = {"factor": jnp.float32(1.0)}
    transform = lambda grads: jax.tree.map(lambda a: a * held["factor"], grads)  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1e6, pre_clipping_transform=transform)
    first = g(params, x)
    held["factor"] = jnp.float32(3.0)
    for a, b in zip(jax.tree.leaves(g(params, x)), jax.tree.leaves(first), strict=True):
        np.testing.assert_allclose(a, 3 * b, rtol=1e-6)


def test_an_eager_calls_errors_are_the_engines():
    """The per-example loss is traced before the program, the arguments checked before it,
    and the microbatches split inside it: each error as it was, naming what is wrong."""
    params = {"w": jnp.ones((4, 3))}
    g = optclip.clipped_grad(lambda p, x: x @ p["w"], l2_clip_norm=1.0)
    with pytest.raises(TypeError, match="must return a real scalar loss for one example"):
        g(params, jnp.ones((2, 4)))
    loss = lambda p, x: jnp.sum(x @ p["w"])  # noqa: E731
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    with pytest.raises(ValueError, match=r"`is_padding_example` must be a bool array of shape"):
        g(params, jnp.ones((2, 4)), is_padding_example=jnp.zeros((3,), bool))
    g = optclip.clipped_grad(loss, l2_clip_norm=1.0, microbatch_size=4)
    with pytest.raises(
        ValueError, match=r"`microbatch_size` \(4\) must divide the batch size \(6\)"
    ):
        g(params, jnp.ones((6, 4)))
