"""`clipped_grad` on weights used in parts: split (``jnp.split`` of fused gates or a fused QKV
weight), sliced (``w[:4]``, ``w[:, ::2]``), or taken by a `dynamic_slice` at a start written in
the loss (KerasHub's positions). Each part's per-example gradient is the leaf's in that part
and zero elsewhere, so disjoint parts have no cross terms and uses of one part have them; the
norms and clipped sums are checked against a float64 reference built from materialised
per-example gradients. Parts that overlap have no closed cross term: that leaf is
materialised, and `ghost_report` says why."""

import ghost_models as gm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ghost_models import RTOL, assert_tree_close
from jax import lax
from reference import run

import optclip


def _params(rng, **shapes):
    return {k: jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32) for k, s in shapes.items()}


def split_gates(rng):
    """A GRU cell as dm-haiku writes it, under `lax.scan`: the input and recurrent weights
    each split into their gates (three parts of one leaf, disjoint: no cross terms), the
    recurrent one used at every step (cross terms across the steps, within each part)."""
    d, h = 4, 5
    params = _params(rng, wx=(d, 3 * h), wh=(h, 3 * h))

    def loss(p, xs):
        wz, wr, wn = jnp.split(p["wx"], 3, axis=1)
        uz, ur, un = jnp.split(p["wh"], 3, axis=1)

        def cell(state, x):
            z = jax.nn.sigmoid(x @ wz + state @ uz)
            r = jax.nn.sigmoid(x @ wr + state @ ur)
            n = jnp.tanh(x @ wn + (r * state) @ un)
            state = (1 - z) * state + z * n
            return state, state

        _, states = lax.scan(cell, jnp.zeros((xs.shape[0], h)), jnp.swapaxes(xs, 0, 1))
        return jnp.sum(states[-1] ** 2)

    return loss, params, jnp.asarray(rng.normal(size=(6, 3, d)), jnp.float32)


def sliced_rows_and_strides(rng):
    """Parts along the contracted dimension (``w[:4]``, ``w[4:]``) of one leaf, and the even
    and odd columns (``v[:, ::2]``, ``v[:, 1::2]``) of another."""
    params = _params(rng, w=(8, 6), v=(6, 10))

    def loss(p, x):
        h = jnp.tanh(x[..., :4] @ p["w"][:4]) + jnp.sin(x[..., 4:] @ p["w"][4:])
        return jnp.sum(jnp.tanh(h @ p["v"][:, ::2]) * jnp.cos(h @ p["v"][:, 1::2]))

    return loss, params, jnp.asarray(rng.normal(size=(6, 3, 8)), jnp.float32)


def one_part_twice(rng):
    """One part used twice (``a`` and ``a.T``: a cross term between its uses) beside another
    part of the same leaf used once (no cross term with the first)."""
    params = _params(rng, w=(6, 12))

    def loss(p, x):
        a = p["w"][:, 2:10]
        h = jnp.tanh(x @ a)
        return jnp.sum(jnp.tanh(h @ a.T) ** 2) + jnp.sum(jnp.sin(x @ p["w"][:, 10:]))

    return loss, params, jnp.asarray(rng.normal(size=(6, 2, 6)), jnp.float32)


def positions_by_dynamic_slice(rng):
    """A table's rows taken as KerasHub takes its positions, ``lax.dynamic_slice(table, (0,
    0), (T, d))``, at a start written in the loss and at one computed from written numbers
    (clamped as `dynamic_slice` clamps it), each part used as a dense layer's weight."""
    params = _params(rng, pos=(10, 4), w=(3, 5))

    def loss(p, x):
        t = x.shape[-2]
        first = lax.dynamic_slice(p["pos"], (0, 0), (t, 4))
        last = lax.dynamic_slice(p["pos"], (2 * 4, 0), (t, 4))  # clamped to start 7
        h = jnp.tanh(x @ first.T) @ p["w"] + jnp.sin(x @ last.T) @ p["w"]
        return jnp.sum(h**2)

    return loss, params, jnp.asarray(rng.normal(size=(6, 3, 4)), jnp.float32)


def part_of_a_part(rng):
    """A part of a part (``w[:, 2:10][:, 1::2]``: columns 3, 5, 7 and 9) beside another part
    of the same leaf (its first two columns): disjoint, no cross term."""
    params = _params(rng, w=(6, 12))

    def loss(p, x):
        odd = p["w"][:, 2:10][:, 1::2]
        return jnp.sum(jnp.tanh(x @ odd) ** 2) + jnp.sum(jnp.sin(x @ p["w"][:, :2]))

    return loss, params, jnp.asarray(rng.normal(size=(6, 2, 6)), jnp.float32)


def positions_added(rng):
    """Learned positions sliced to the sequence and added, as Haiku and NNX models write them
    (``x + pos[:T]``), and a disjoint part taken by a `dynamic_slice` and subtracted: the
    parts' per-example gradients are the output gradients (negated for the subtracted one)."""
    params = _params(rng, pos=(10, 4), w=(3, 4), v=(4, 4))

    def loss(p, x):
        t = x.shape[-2]
        h = jnp.tanh(x @ p["w"] + p["pos"][:t])
        h = jnp.tanh(h @ p["v"] - lax.dynamic_slice(p["pos"], (5, 0), (t, 4)))
        return jnp.sum(h**2)

    return loss, params, jnp.asarray(rng.normal(size=(6, 3, 3)), jnp.float32)


def one_added_part_twice(rng):
    """One part of a table added twice (a cross term between the uses), transposed once,
    beside a dense use of another part of the same leaf (no cross term)."""
    params = _params(rng, pos=(10, 4), w=(3, 4))

    def loss(p, x):
        t = x.shape[-2]
        a = p["pos"][2 : 2 + t]
        h = jnp.tanh(x @ p["w"] + a)
        g = jnp.sin(h.swapaxes(-1, -2) + a.T) @ p["pos"][6:9]
        return jnp.sum(g**2)

    return loss, params, jnp.asarray(rng.normal(size=(6, 3, 3)), jnp.float32)


MODELS = {
    "split gates in a scan": split_gates,
    "sliced rows and strides": sliced_rows_and_strides,
    "one part twice": one_part_twice,
    "positions by dynamic_slice": positions_by_dynamic_slice,
    "a part of a part": part_of_a_part,
    "positions added": positions_added,
    "one added part twice": one_added_part_twice,
}


def step(loss, clip):
    return optclip.clipped_grad(loss, l2_clip_norm=clip, return_grad_norms=True)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize("name", list(MODELS))
def test_parts_of_a_weight_go_ghost_and_match_the_float64_reference(name, mode):
    """Every leaf ghost; the norms and the clipped sums those of the float64 reference, with a
    clip between the examples' norms (some clipped, some not) and a padding example."""
    loss, params, x = MODELS[name](np.random.default_rng(0))
    report = optclip.ghost_report(loss, params, x)
    assert {r.mode for r in report.values()} == {"ghost"}, report
    norms, _ = gm.reference(loss, params, x, 1.0)
    clip = float(np.median(norms))
    padding = np.arange(x.shape[0]) == 2
    grads, aux = run(step(loss, clip), mode)(params, x, is_padding_example=padding)
    ref_norms, sums = gm.reference(loss, params, x, clip, padding)
    kept = ~padding
    np.testing.assert_allclose(np.asarray(aux.grad_norms)[kept], ref_norms[kept], rtol=RTOL)
    assert_tree_close(grads, sums)


def test_ghost_report_names_the_disjoint_parts_and_the_cross_terms():
    reports = {
        name: optclip.ghost_report(*m(np.random.default_rng(1))) for name, m in MODELS.items()
    }
    assert reports["split gates in a scan"]["['wx']"].reason == (
        "ghost: 3 use(s), dense, 3 disjoint parts"
    )
    assert reports["split gates in a scan"]["['wh']"].reason.endswith(", 3 disjoint parts")
    assert reports["one part twice"]["['w']"].reason == (
        "ghost: 3 use(s), dense with cross terms, 2 disjoint parts"
    )
    assert reports["sliced rows and strides"]["['v']"].reason.endswith("2 disjoint parts")
    assert reports["positions added"]["['pos']"].reason == (
        "ghost: 2 use(s), added, 2 disjoint parts"
    )
    assert reports["one added part twice"]["['pos']"].reason == (
        "ghost: 3 use(s), added, dense with cross terms, 2 disjoint parts"
    )


def test_overlapping_parts_are_materialised_with_their_reason():
    rng = np.random.default_rng(2)
    params = _params(rng, w=(6, 12))

    def loss(p, x):  # columns 4 to 7 in both parts
        return jnp.sum(jnp.tanh(x @ p["w"][:, :8])) + jnp.sum(jnp.tanh(x @ p["w"][:, 4:]) ** 2)

    x = jnp.asarray(rng.normal(size=(5, 2, 6)), jnp.float32)
    (leaf,) = optclip.ghost_report(loss, params, x).values()
    assert leaf.mode == "materialised"
    assert leaf.reason == "used through overlapping slices (no closed cross term)"
    grads, aux = jax.jit(step(loss, 1.0))(params, x)
    norms, sums = gm.reference(loss, params, x, 1.0)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL)
    assert_tree_close(grads, sums)


def test_an_added_part_also_multiplied_or_a_whole_table_added_is_materialised():
    """A part both added and used as a dense layer's weight has no closed cross term (two
    layouts); a whole leaf added is a bias, whose per-example gradient is no larger than the
    output gradient a tap would hold."""
    rng = np.random.default_rng(5)
    params = _params(rng, pos=(10, 3), bias=(3, 3))

    def loss(p, x):
        t = x.shape[-2]
        h = jnp.tanh(x + p["pos"][:t] + p["bias"])
        return jnp.sum(h @ p["pos"][:t].T)

    x = jnp.asarray(rng.normal(size=(5, 3, 3)), jnp.float32)
    report = optclip.ghost_report(loss, params, x)
    assert report["['pos']"].reason == (
        "used by closed-form operations in different layouts (no closed cross term)"
    )
    assert report["['bias']"].reason == (
        "elementwise `add` (a bias or a scale): per-example gradient of the parameter's size"
    )
    grads, aux = jax.jit(step(loss, 1.0))(params, x)
    norms, sums = gm.reference(loss, params, x, 1.0)
    np.testing.assert_allclose(np.asarray(aux.grad_norms), norms, rtol=RTOL)
    assert_tree_close(grads, sums)


def test_a_part_at_a_start_the_loss_computes_from_the_data_is_materialised():
    """A `dynamic_slice` whose start depends on the example has no closed form here."""
    rng = np.random.default_rng(3)
    params = _params(rng, pos=(10, 4))

    def loss(p, x):
        start = jnp.argmax(x[0, :, 0]).astype(jnp.int32)
        return jnp.sum(jnp.tanh(x @ lax.dynamic_slice(p["pos"], (start, 0), (4, 4)).T))

    x = jnp.asarray(rng.normal(size=(5, 3, 4)), jnp.float32)
    (leaf,) = optclip.ghost_report(loss, params, x).values()
    assert leaf.mode == "materialised" and "dynamic_slice" in leaf.reason, leaf


def split_at_extreme_magnitudes(rng):
    """A weight split in two, its inputs at 1e20: one part's per-example gradients are near
    1e20, the other's near 1."""
    params = _params(rng, w=(4, 6))

    def loss(p, x):
        a, b = jnp.split(p["w"], [2], axis=1)
        return jnp.sum(x @ a) + jnp.sum(jnp.sin(x @ b * 1e-20))

    return loss, params, jnp.asarray(rng.normal(size=(5, 3, 4)) * 1e20, jnp.float32)


def positions_added_at_extreme_magnitudes(rng):
    """Positions sliced and added, their output gradients near 1e20 in one part and near
    1e-20 (every square underflows) in the other."""
    params = _params(rng, pos=(8, 4))

    def loss(p, x):
        t = x.shape[-2]
        big = jnp.sum(jnp.sin(x + p["pos"][:t])) * 1e20
        return big + jnp.sum(jnp.cos(x - p["pos"][4 : 4 + t])) * 1e-20

    return loss, params, jnp.asarray(rng.normal(size=(5, 3, 4)), jnp.float32)


@pytest.mark.parametrize("mode", ["jit", "eager"])
@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (split_at_extreme_magnitudes, "ghost: 2 use(s), dense, 2 disjoint parts"),
        (positions_added_at_extreme_magnitudes, "ghost: 2 use(s), added, 2 disjoint parts"),
    ],
)
def test_parts_exact_with_a_nan_example_and_squares_that_overflow(model, reason, mode):
    """Per-example gradients near 1e20 in one part (every square overflows float32); one
    example not finite: its norm is NaN and it is dropped (``nan_safe``); the others' norms
    and clipped sums are the float64 reference's."""
    loss, params, x = model(np.random.default_rng(4))
    bad = x.at[1, 0, 0].set(jnp.nan)
    kept = np.delete(np.arange(x.shape[0]), 1)
    (leaf,) = optclip.ghost_report(loss, params, x).values()
    assert leaf.reason == reason, leaf
    grads, aux = run(step(loss, 1.0), mode)(params, bad)
    norms, sums = gm.reference(loss, params, x[kept], 1.0)
    assert np.isnan(aux.grad_norms[1])
    assert np.all(norms > 1e19)
    np.testing.assert_allclose(np.asarray(aux.grad_norms)[kept], norms, rtol=RTOL)
    assert_tree_close(grads, sums)
