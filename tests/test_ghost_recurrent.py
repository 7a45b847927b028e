"""`clipped_grad` on recurrent cells as Equinox, Flax Linen and dm-haiku write them, and as a
plain `lax.scan`: Equinox's `GRUCell` and `LSTMCell`, Linen's ``nn.RNN`` of an `LSTMCell` and
of a `GRUCell`, Haiku's ``DeepRNN`` of an `LSTM` and a `GRU` under ``hk.dynamic_unroll`` (its
GRU splits each weight into the gates'), and an LSTM whose one fused gate weight is split at
every step. Each model's weights go ghost; its norms and clipped sum equal the float64
reference with some examples clipped and some not, a padding example, a NaN example, and the
loss scaled until the squares of its gradients overflow or flush; one jitted program per
model serves every check, and one eager call per model runs in the slow tier."""

import functools

import equinox as eqx
import ghost_models as gm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from reference import equations, load_benchmark, run

import optclip

F, H, T, B, OUT = 3, 4, 5, 5, 2  # (input features, hidden units, steps, examples, outputs)


def _drawn(rng, params):
    """`params` (abstract, `jax.ShapeDtypeStruct` leaves) with every floating leaf drawn by
    NumPy: about ``1/sqrt(fan-in)`` for a matrix, about 0 for a bias (noise of 0.3). Other
    leaves are left as they are."""

    def draw(leaf):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        scale = 1 / np.sqrt(min(leaf.shape)) if len(leaf.shape) > 1 else 0.3
        return jnp.asarray(scale * rng.normal(size=leaf.shape), jnp.float32)

    return jax.tree.map(draw, params)


def _head_loss(outputs):
    """A loss of every step's (or the last step's) outputs: not a sum of the outputs alone,
    so that every gate's gradient differs from step to step."""
    return jnp.sum(jnp.sin(outputs) + 0.5 * outputs**2)


def equinox_model(cell_type):
    """An Equinox cell (`eqx.nn.GRUCell` or `eqx.nn.LSTMCell`) under `lax.scan` over one
    example's steps, a `eqx.nn.Linear` head on every step's hidden state; the model vmapped
    over the size-1 batch axis."""

    class Model(eqx.Module):
        cell: eqx.Module
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.cell = cell_type(F, H, key=k1)
            self.head = eqx.nn.Linear(H, OUT, key=k2)

        def __call__(self, xs):  # (T, F) -> (T, OUT)
            zeros = jnp.zeros(H, xs.dtype)
            lstm = isinstance(self.cell, eqx.nn.LSTMCell)

            def step(state, x):
                state = self.cell(x, state)
                return state, state[0] if lstm else state

            _, hs = jax.lax.scan(step, (zeros, zeros) if lstm else zeros, xs)
            return jax.vmap(self.head)(hs)

    def build(rng):
        model = _drawn(rng, eqx.filter_eval_shape(Model, jax.random.key(0)))
        params, static = eqx.partition(model, eqx.is_inexact_array)

        def loss(p, x):
            return _head_loss(jax.vmap(eqx.combine(p, static))(x))

        return loss, params

    return build


def flax_model(cell_name):
    """Linen's ``nn.RNN`` of ``nn.LSTMCell`` or ``nn.GRUCell`` (a lifted `scan`) and a
    ``nn.Dense`` head, applied to the example as a batch of one."""

    def build(rng):
        import flax.linen as nn

        class Model(nn.Module):
            dtype: jnp.dtype = jnp.float32  # (the carry's: float64 in the reference)

            @nn.compact
            def __call__(self, x):  # (1, T, F) -> (1, T, OUT)
                cell = getattr(nn, cell_name)(H, param_dtype=self.dtype)
                return nn.Dense(OUT)(nn.RNN(cell)(x))

        shapes = jax.eval_shape(Model().init, jax.random.key(0), jnp.zeros((1, T, F)))

        def loss(p, x):
            return _head_loss(Model(x.dtype).apply({"params": p}, x))

        return loss, _drawn(rng, shapes["params"])

    return build


def haiku_model(rng):
    """dm-haiku's ``hk.DeepRNN([hk.LSTM(H), hk.GRU(H)])`` under ``hk.dynamic_unroll`` and an
    ``hk.Linear`` head, on one example's steps (vmapped over the size-1 batch axis)."""
    import haiku as hk

    def outputs(xs):  # (T, F) -> (T, OUT)
        core = hk.DeepRNN([hk.LSTM(H), hk.GRU(H)])
        hs, _ = hk.dynamic_unroll(core, xs, core.initial_state(None))
        return hk.Linear(OUT)(hs)

    model = hk.without_apply_rng(hk.transform(outputs))
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((T, F)))

    def loss(p, x):
        return _head_loss(jax.vmap(lambda xs: model.apply(p, xs))(x))

    return loss, _drawn(rng, shapes)


def fused_lstm(rng):
    """An LSTM in plain JAX: one fused ``(F + H, 4 H)`` gate weight and one bias, split into
    the four gates' with `jnp.split` inside the scanned step."""
    params = _drawn(rng, {"gates": jnp.zeros((F + H, 4 * H)), "bias": jnp.zeros(4 * H)})
    params["head"] = _drawn(rng, jnp.zeros((H, OUT)))

    def loss(p, x):  # x: (1, T, F)
        def step(state, xt):
            hidden, cell = state
            ws, bs = jnp.split(p["gates"], 4, axis=1), jnp.split(p["bias"], 4)
            xh = jnp.concatenate([xt, hidden], axis=-1)
            i, f, g, o = (xh @ w + b for w, b in zip(ws, bs))
            cell = jax.nn.sigmoid(f) * cell + jax.nn.sigmoid(i) * jnp.tanh(g)
            hidden = jax.nn.sigmoid(o) * jnp.tanh(cell)
            return (hidden, cell), hidden

        zeros = jnp.zeros((x.shape[0], H), x.dtype)
        _, hs = jax.lax.scan(step, (zeros, zeros), jnp.swapaxes(x, 0, 1))
        return _head_loss(hs @ p["head"])

    return loss, params


def called_product(rng):
    """A plain `lax.scan` cell whose step calls a jitted product of its activations (each
    example's outer product, no parameter inside): a call with no site, which the tapped pass
    evaluates inline so that its product is kept for the backward pass."""
    params = _drawn(rng, {"w": jnp.zeros((F, H)), "u": jnp.zeros((H, H))})
    params["head"] = _drawn(rng, jnp.zeros((H, OUT)))
    outer = jax.jit(lambda a: jax.lax.batch_matmul(a[:, :, None], a[:, None, :]))

    def loss(p, x):  # x: (1, T, F)
        def step(hidden, xt):
            a = jnp.tanh(xt @ p["w"] + hidden @ p["u"])
            hidden = jnp.tanh(a + jnp.mean(outer(a), axis=-1))
            return hidden, hidden

        _, hs = jax.lax.scan(step, jnp.zeros((x.shape[0], H), x.dtype), jnp.swapaxes(x, 0, 1))
        return _head_loss(hs @ p["head"])

    return loss, params


MODELS = {
    "equinox GRUCell": equinox_model(eqx.nn.GRUCell),
    "equinox LSTMCell": equinox_model(eqx.nn.LSTMCell),
    "flax nn.RNN(LSTMCell)": flax_model("LSTMCell"),
    "flax nn.RNN(GRUCell)": flax_model("GRUCell"),
    "haiku DeepRNN(LSTM, GRU)": haiku_model,
    "lax.scan LSTM, fused gates split": fused_lstm,
    "lax.scan cell calling a jitted product": called_product,
}
# (The fused LSTM's split gates are in the fast tier's `test_ghost_parts.py` too.)
SLOW_MODELS = ("flax nn.RNN(GRUCell)", "lax.scan LSTM, fused gates split")
FAST = [n if n not in SLOW_MODELS else pytest.param(n, marks=pytest.mark.slow) for n in MODELS]


@functools.cache
def built(name):
    """`MODELS[name]`'s loss, parameters, batch (`B` examples of `T` steps) and float64
    per-example gradients: built once for every test of the model."""
    rng = np.random.default_rng(7)
    loss, params = MODELS[name](rng)
    x = rng.normal(size=(B, T, F)).astype(np.float32)
    return loss, params, x, gm.per_example_grads(loss, params, x)


def _step(loss, clip, mode):
    """``step(params, x, magnitude, padding)``: `clipped_grad`'s sums and norms of the loss
    times `magnitude` (an argument: one program for every magnitude and batch)."""

    def step(params, x, magnitude, padding):
        scaled = lambda p, x: loss(p, x) * magnitude  # noqa: E731
        g = optclip.clipped_grad(scaled, l2_clip_norm=clip, return_grad_norms=True)
        return g(params, x, is_padding_example=padding)

    return run(step, mode)


def _check(result, grads64, clip, **reference):
    norms, sums = gm.reference_from(grads64, clip, **reference)
    np.testing.assert_allclose(np.asarray(result[1].grad_norms), norms, rtol=gm.RTOL)
    gm.assert_tree_close(result[0], sums)


def _threshold(grads64):
    """A threshold between the examples' norms: some clipped, some not."""
    return float(np.median(gm.reference_from(grads64, 1.0)[0]))


@pytest.mark.every_case
@pytest.mark.parametrize("name", FAST)
def test_recurrent_cells_go_ghost_and_match_the_float64_reference(name):
    loss, params, x, grads64 = built(name)
    report = optclip.ghost_report(loss, params, x)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    shapes = [leaf.shape for leaf in jax.tree.leaves(params)]
    for path, shape in zip(paths, shapes, strict=True):  # (every weight; biases may not)
        if len(shape) == 2:
            assert report[path].mode == "ghost", (path, report[path])
    clip = _threshold(grads64)
    step = _step(loss, clip, "jit")
    none = np.zeros(B, bool)
    padding = none.copy()
    padding[2] = True
    result = step(params, x, np.float32(1), padding)
    norms = gm.reference_from(grads64, clip)[0]
    assert (norms > clip).any() and (norms < clip).any(), norms
    _check(result, grads64, clip, padding=padding)
    for magnitude in (1e22, 1e-24):  # (the squares of its gradients overflow; flush)
        _check(step(params, x, np.float32(magnitude), none), grads64, clip, magnitude=magnitude)
    bad = x.copy()
    bad[1, T // 2, 0] = np.nan  # (one step of one example: the NaN reaches the later steps)
    grads, aux = step(params, bad, np.float32(1), none)
    assert np.isnan(aux.grad_norms[1]) and np.isfinite(np.delete(aux.grad_norms, 1)).all()
    _, sums = gm.reference_from(grads64, clip, keep=[0, 2, 3, 4])
    gm.assert_tree_close(grads, sums)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_recurrent_cells_eagerly(name):
    loss, params, x, grads64 = built(name)
    clip = _threshold(grads64)
    padding = np.arange(B) == 4
    result = _step(loss, clip, "eager")(params, x, np.float32(1), padding)
    _check(result, grads64, clip, padding=padding)


SHARING = {  # case: (variables tapped, products tapped)
    "added": (1, 2),
    "also read alone": (2, 2),
    "one weight twice": (1, 2),
    "split into gates": (2, 2),
    "a split part also read": (3, 2),
    "split into gates, vmapped": (2, 2),
    "split into gates, one weight": (2, 2),
}


def _sharing_loss(case):
    """One example's loss of a recurrent cell in the shape of `case` (`SHARING`): an LSTM's
    sum of products before a gate, or a GRU's two products split into three gates each (as
    Equinox writes it), two of the three added."""

    def gru(gates_x, gates_h, h, axis):
        i_r, i_z, i_n = jnp.split(gates_x, 3, axis=axis)
        h_r, h_z, h_n = jnp.split(gates_h, 3, axis=axis)
        r, z = jax.nn.sigmoid(i_r + h_r), jax.nn.sigmoid(i_z + h_z)
        n = jnp.tanh(i_n + r * h_n) * (jnp.cos(h_z) if case.startswith("a split") else 1)
        return (1 - z) * n + z * h

    def step(p, h, xt):
        if case.endswith("vmapped"):  # (``W @ x`` per example, as Equinox writes it)
            cell = lambda h, x: gru(p["w"].T @ x + p["b"], p["u"].T @ h, h, 0)  # noqa: E731
            return jax.vmap(cell)(h, xt)
        a = xt @ p["w"]
        if case.startswith(("split", "a split")):
            recurrent = p["w"] if case.endswith("one weight") else p["u"]
            return gru(a + p["b"], h @ recurrent, h, -1)
        gate = jnp.sin(a) if case == "also read alone" else 1  # (read before the sum)
        recurrent = p["w"] if case == "one weight twice" else p["u"]
        return jnp.tanh(a + h @ recurrent + p["b"]) * gate

    def loss(p, x):  # x: (1, T, H)
        def body(h, xt):
            h = step(p, h, xt)
            return h, h

        _, hs = jax.lax.scan(body, jnp.zeros((x.shape[0], H), x.dtype), jnp.swapaxes(x, 0, 1))
        return _head_loss(hs)

    return loss


def _sharing_case(case, seed):
    """`case`'s loss, drawn parameters and batch, their float64 per-example gradients and a
    threshold between the examples' norms."""
    rng = np.random.default_rng(seed)
    gates = 3 if case.startswith(("split", "a split")) else 1
    shapes = {"w": (H, gates * H), "u": (H, gates * H), "b": (gates * H,)}
    params = {
        k: jnp.asarray(rng.normal(size=shape) / 2, jnp.float32) for k, shape in shapes.items()
    }
    loss = _sharing_loss(case)
    x = rng.normal(size=(B, T, H)).astype(np.float32)
    grads64 = gm.per_example_grads(loss, params, x)
    return loss, params, x, grads64, _threshold(grads64)


@pytest.mark.every_case
@pytest.mark.parametrize("case", list(SHARING))
def test_output_gradients_are_tapped_once_per_sum_and_per_part(case, monkeypatch):
    """``x W + h U + b`` (an LSTM's gates as Equinox and Flax write them): both products'
    output gradients are the sum's, tapped once. A product also read on its own has an output
    gradient of its own. One weight used twice in the sum (``x W + h W``) shares it too, with
    its uses' cross terms. Two products split into three gates each, two of them added (a GRU
    as Equinox and dm-haiku write it): each product's output gradient is its parts' sums side
    by side, four variables tapped for two products of three parts, also where each product
    is transposed before its split (``W @ x`` under `jax.vmap`); a part also read on its own
    (``cos(h_z)``) is tapped by itself. One weight in both split products has its two uses'
    cross terms: their output gradients' pieces joined (`_pieces.joined`). The numbers equal
    the float64 reference in every case, at ordinary magnitudes and at 1e22."""
    from optclip.per_example.ghost import _shared

    found = []
    monkeypatch.setattr(
        _shared, "place", lambda *a, f=_shared.place: found.append(f(*a)) or found[-1]
    )
    loss, params, x, grads64, clip = _sharing_case(case, 3)
    step = _step(loss, clip, "jit")
    none = np.zeros(B, bool)
    for magnitude in (1.0, 1e22):
        result = step(params, x, np.float32(magnitude), none)
        _check(result, grads64, clip, magnitude=magnitude)
    assert found
    for placed in found:
        assert (len(placed.at), len(placed.gradients)) == SHARING[case], (case, placed)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SHARING))
def test_output_gradients_tapped_once_eagerly(case):
    loss, params, x, grads64, clip = _sharing_case(case, 4)
    padding = np.arange(B) == 1
    result = _step(loss, clip, "eager")(params, x, np.float32(1e-24), padding)
    _check(result, grads64, clip, padding=padding, magnitude=1e-24)


@pytest.mark.every_case
@pytest.mark.parametrize("name", ["equinox GRUCell", "equinox LSTMCell"])
def test_no_reduction_or_sum_contracts_a_size_1_dimension_beside_others(name):
    """A cell vmapped over the batch, as Equinox models are, makes its products' operands and
    output gradients end in a size-1 dimension. The exponents' reductions take such an array
    over one merged dimension, and a dense site's clipped sum contracts no size-1 dimension
    beside the examples': XLA's CPU runtime runs a reduction over ``(..., S, 1)`` several
    times slower, and transposes an operand of a product that contracts ``(B*T, 1, C)``
    with ``(B*T, O, 1)``. (The numbers are checked by the tests above.)"""
    loss, params, x, _ = built(name)
    step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    eqns = list(equations(jax.make_jaxpr(step)(params, x).jaxpr))
    reductions = [e for e in eqns if e.primitive.name == "reduce_max"]
    products = [e for e in eqns if e.primitive.name == "dot_general"]
    assert reductions and products
    for eqn in reductions:
        shape, axes = eqn.invars[0].aval.shape, eqn.params["axes"]
        last_of_several = len(axes) > 1 and len(shape) - 1 in axes
        assert not (last_of_several and shape[-1] == 1), eqn
    for eqn in products:
        (contract, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        assert len(contract) == 1 or all(shape[d] != 1 for d in contract), eqn


@functools.cache
def _product_work():
    """`private_parts.dot_flops` (``benchmarks/profile/private_parts.py``): the matrix
    products' operations of a jaxpr, a scan's body counted as often as it runs."""
    return load_benchmark("profile/private_parts.py").dot_flops


def test_a_scans_step_keeps_where_its_gradients_are_taken_and_computes_the_rest_again(
    monkeypatch,
):
    """`_interpret.SCAN_SAVES`: the tapped pass's scans keep each step's values where its
    sites' output gradients are taken (`_shared.Placement.kept`: an LSTM's sum of its two
    products, not the products) and compute the gates again, since every step's records and
    output gradients are kept beside them. An LSTM written with `lax.scan` takes less memory
    by XLA's analysis than with its products kept (JAX's `dots_saveable`) or with every value
    of its steps kept."""
    from optclip.per_example.ghost import _interpret

    rng = np.random.default_rng(3)
    steps, batch, hidden = 32, 32, 64
    params = {
        "w": jnp.asarray(rng.normal(size=(hidden, 4 * hidden)) * 0.1, jnp.float32),
        "u": jnp.asarray(rng.normal(size=(hidden, 4 * hidden)) * 0.1, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(batch, steps, hidden)), jnp.float32)

    def loss(p, xs):  # (one example of a batch of one: xs is (1, T, hidden))
        def cell(carry, xt):
            h, c = carry
            i, f, g, o = jnp.split(xt @ p["w"] + h @ p["u"], 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return (h, c), h

        zeros = jnp.zeros((xs.shape[0], hidden), xs.dtype)
        _, hs = jax.lax.scan(cell, (zeros, zeros), jnp.swapaxes(xs, 0, 1))
        return jnp.sum(jnp.sin(hs))

    def peak(policy):
        monkeypatch.setattr(_interpret, "SCAN_SAVES", policy)
        return gm.compiled_peak(optclip.clipped_grad(loss, l2_clip_norm=1.0), params, x)

    kept = peak(_interpret.SCAN_SAVES)
    products_kept = peak(jax.checkpoint_policies.dots_saveable)
    everything_kept = peak(jax.checkpoint_policies.everything_saveable)
    # (0.83x and 0.75x at this shape, XLA of jax 0.10.2 on a CPU)
    assert kept < 0.9 * products_kept, (kept, products_kept)
    assert kept < 0.85 * everything_kept, (kept, everything_kept)


@pytest.mark.parametrize("name", FAST)
def test_a_scans_step_computes_no_product_again(name, monkeypatch):
    """What a scan's step keeps (`_interpret.SCAN_SAVES`) spares every product the backward
    pass would otherwise compute again: the ghost step does the multiply-adds it does with
    every value of its steps kept. A GRU as Equinox and dm-haiku write it adds two of its
    input product's parts to its state product's, and reads the third part of the state
    product alone: kept at its products' outputs instead, the state product is computed
    again."""
    from optclip.per_example.ghost import _interpret

    loss, params, x, _ = built(name)

    def work(policy):
        monkeypatch.setattr(_interpret, "SCAN_SAVES", policy)
        step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
        return _product_work()(jax.make_jaxpr(step)(params, x).jaxpr)

    assert work(_interpret.SCAN_SAVES) == work(jax.checkpoint_policies.everything_saveable)


def test_a_scans_step_keeps_the_products_of_the_functions_it_calls(monkeypatch):
    """A product of activations inside a jitted function that a scan's step calls (no
    parameter inside: not a site) is kept like the step's own products (`_jaxprs.call_products`),
    not computed again in the backward pass (its sums and norms are checked against the
    float64 reference with the other models)."""
    from optclip.per_example.ghost import _interpret

    loss, params, x, _ = built("lax.scan cell calling a jitted product")

    def work(policy):
        monkeypatch.setattr(_interpret, "SCAN_SAVES", policy)
        step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
        return _product_work()(jax.make_jaxpr(step)(params, x).jaxpr)

    assert work(_interpret.SCAN_SAVES) == work(jax.checkpoint_policies.everything_saveable)


@pytest.mark.parametrize("name", ["equinox GRUCell", "flax nn.RNN(LSTMCell)"])
def test_a_record_that_is_a_scans_input_is_not_stacked_again(name):
    """A site's record that is a step's slice of the scan's ``xs`` (a cell's input) is that
    ``xs`` (`_interpret._scan`), not a stack the scan writes: no scan in the step outputs an
    array of every example's and step's inputs. The numbers are checked above."""
    loss, params, x, _ = built(name)
    step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    eqns = equations(jax.make_jaxpr(step)(params, x).jaxpr)
    outputs = [v.aval for e in eqns if e.primitive.name == "scan" for v in e.outvars]
    assert not [a for a in outputs if a.size == B * T * F and F in a.shape], outputs


def _repeated_stacks(jaxpr) -> list:
    """The stacked outputs of `jaxpr`'s scans that their body writes from a variable it
    already writes to another stacked output."""
    found = []
    for e in equations(jaxpr):
        if e.primitive.name == "scan":
            ys = e.params["jaxpr"].jaxpr.outvars[e.params["num_carry"] :]
            variables = [v for v in ys if isinstance(v, jcore.Var)]
            found += [v.aval for i, v in enumerate(variables) if v in variables[:i]]
    return found


@pytest.mark.parametrize(
    "name", ["equinox GRUCell", "flax nn.RNN(GRUCell)", "haiku DeepRNN(LSTM, GRU)"]
)
def test_a_state_both_recorded_and_kept_for_the_backward_pass_is_stacked_once(name, monkeypatch):
    """A GRU's state ``h_{t-1}`` is a site's record (``W_hh h``) and a value its backward pass
    reads (the update gate mixes it in): the forward scan wrote it to two stacks, one as the
    record and one as JAX's residual. `_repeats.merged` keeps one, and no scan in the step
    writes a variable twice. The numbers are checked above."""
    from optclip.per_example.ghost import _repeats

    loss, params, x, _ = built(name)
    step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    assert _repeated_stacks(jax.make_jaxpr(step)(params, x).jaxpr) == []
    monkeypatch.setattr(_repeats, "merged", lambda f: f)
    step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    assert _repeated_stacks(jax.make_jaxpr(step)(params, x).jaxpr) != []


def _first_stack_dropped(jaxpr):
    """`jaxpr` with its first scan's first stacked output (read by nothing) a `DropVar`."""
    eqn = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    outvars = list(eqn.outvars)
    at = eqn.params["num_carry"]
    outvars[at] = jcore.DropVar(outvars[at].aval)
    eqns = [e.replace(outvars=outvars) if e is eqn else e for e in jaxpr.eqns]
    return jaxpr.replace(eqns=eqns)


def _reads_only_defined(jaxpr) -> bool:
    """Whether every variable `jaxpr`'s equations and outputs read is one of its inputs or an
    output of an equation before (not a `DropVar`)."""
    defined = set(jaxpr.constvars) | set(jaxpr.invars)
    for e in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and v not in defined for v in e.invars):
            return False
        defined |= {v for v in e.outvars if not isinstance(v, jcore.DropVar)}
    return all(not isinstance(v, jcore.Var) or v in defined for v in jaxpr.outvars)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_scans_repeated_stacks_are_read_as_one(reverse):
    """`_repeats.without_repeats` on a scan that stacks its carry three times (two of them
    read after it, one a residual of its gradient, one dropped): the same values and
    gradients, one stack; with the first stack dropped, the one kept is the next read."""
    from optclip.per_example.ghost import _repeats

    def f(w, xs):
        def step(c, x):
            h = jnp.tanh(c * w + x)
            return h, (c, h * c, c, c)

        _, (_, b, c, d) = jax.lax.scan(step, jnp.ones(3), xs, reverse=reverse)
        return jnp.sum(d * 2.0 + b) - jnp.sum(c) ** 2

    w, xs = jnp.float32(0.7), jnp.linspace(-2.0, 2.0, 12, dtype=jnp.float32).reshape(4, 3)
    g = jax.value_and_grad(f, argnums=(0, 1))
    want = jax.jit(g)(w, xs)
    got = jax.jit(_repeats.merged(g))(w, xs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    closed = jax.make_jaxpr(g)(w, xs)
    for jaxpr in (closed.jaxpr, _first_stack_dropped(closed.jaxpr)):
        merged = _repeats.without_repeats(jaxpr)
        assert _repeated_stacks(jaxpr) != []
        assert _repeated_stacks(merged) == [] and _reads_only_defined(merged)
        out = jax.jit(lambda *a, j=merged: jax.core.eval_jaxpr(j, closed.consts, *a))(w, xs)
        for a, b in zip(out, jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def _concatenated_gradients(loss, params, x) -> list:
    """The concatenations in `clipped_grad`'s step as large as two gates' output gradients of
    every example and step (a state product's output gradient joined from its parts)."""
    step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
    eqns = equations(jax.make_jaxpr(step)(params, x).jaxpr)
    big = B * T * 2 * H
    return [e for e in eqns if e.primitive.name == "concatenate" and e.outvars[0].aval.size >= big]


@pytest.mark.parametrize(
    ("name", "readers"), [("equinox GRUCell", 2), ("haiku DeepRNN(LSTM, GRU)", 3)]
)
def test_a_gru_reads_its_output_gradients_in_pieces(name, readers, monkeypatch):
    """A GRU's state product's output gradient is parts of its input product's tap beside a
    tap of its own (Equinox), or its two products each a slice of that tap (dm-haiku): the
    tap is cut where those parts start and stop, and every product reads the pieces
    (`_pieces`), each piece scaled once for all of them. No output gradient is joined into a
    new array of every step. The numbers are checked above."""
    from optclip.per_example.ghost import _pieces

    read = []

    def spied(*args, found=_pieces.pieces_of):
        read.append(found(*args))
        return read[-1]

    monkeypatch.setattr(_pieces, "pieces_of", spied)
    loss, params, x, _ = built(name)
    assert _concatenated_gradients(loss, params, x) == []
    assert sum(r is not None for r in read) == readers, read


def _apart_loss(scanned: bool):
    """Two products split into gates (``a = x W``, ``q = tanh(x) U``), ``a``'s first part added
    to ``q``'s: ``q`` reads a piece of ``a``'s tap. ``a``'s record is tiny and its second
    part's gradient near float32's largest, so that the piece ``q`` reads is below float32's
    normal numbers at the tap's largest: only at its own exponent does it keep its digits."""

    def products(p, x):  # x: (S, F) -> the pieces' sum, a's second part
        a = (x * 1e-30) @ p["w"]
        q = jnp.tanh(x) @ p["u"]
        (a1, a2), (q1, q2) = jnp.split(a, [2 * H], axis=-1), jnp.split(q, [2 * H], axis=-1)
        return jnp.sin(a1 + q1) + jnp.cos(q2).sum(-1, keepdims=True), a2

    def loss(p, x):
        if scanned:
            _, (s, a2) = jax.lax.scan(lambda c, xt: (c, products(p, xt[None])), 0.0, x[0])
        else:
            s, a2 = products(p, x[0])
        return jnp.sum(s) + 2e38 * a2.reshape(-1)[0]

    return loss


@pytest.mark.parametrize("scanned", [False, True], ids=["outside scans", "in a scan"])
@pytest.mark.parametrize("mode", ["jit", pytest.param("eager", marks=pytest.mark.slow)])
def test_pieces_of_one_tap_far_apart_each_keep_their_digits(scanned, mode, monkeypatch):
    """Each piece of a cut tap is scaled by its own power of two: a piece ``2**-128`` of its
    tap's largest keeps its digits, and the product reading it gets its clipped sum (at the
    tap's largest exponent it would flush to zero). Also with the norms taken one example at
    a time (`_norms.LOOP_WORK` 0), with a padding example and a NaN example."""
    from optclip.per_example.ghost import _norms

    rng = np.random.default_rng(11)
    params = {
        "w": jnp.asarray(rng.normal(size=(F, 3 * H)), jnp.float32),
        "u": jnp.asarray(rng.normal(size=(F, 3 * H)) / 2, jnp.float32),
    }
    x = rng.normal(size=(B, 1, T, F)).astype(np.float32)
    loss = _apart_loss(scanned)
    grads64 = gm.per_example_grads(loss, params, x)
    clip = _threshold(grads64)
    padding = np.arange(B) == 3
    for loop_work in (_norms.LOOP_WORK, 0):
        monkeypatch.setattr(_norms, "LOOP_WORK", loop_work)
        step = _step(loss, clip, mode)
        result = step(params, x, np.float32(1), padding)
        _check(result, grads64, clip, padding=padding)
        bad = x.copy()
        bad[1, 0, T // 2, 0] = np.nan
        sums, aux = step(params, bad, np.float32(1), np.zeros(B, bool))
        assert np.isnan(aux.grad_norms[1]) and np.isfinite(np.delete(aux.grad_norms, 1)).all()
        gm.assert_tree_close(sums, gm.reference_from(grads64, clip, keep=[0, 2, 3, 4])[1])
