"""Small per-example losses built from the layers ghost clipping knows (and some it does not),
and the float64 reference every `clipped_grad` result is compared with.

Every loss is ``loss(params, x)`` for one example with a leading axis of size 1 (jax_privacy's
default `keep_batch_dim=True`), written for any float dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import optclip

RTOL = 1e-5  # float32 rounding of a norm or a clipped sum, relative to the largest entry


def _init(rng, shapes, dtype=np.float32, scale=0.5):
    return {k: jnp.asarray(rng.normal(size=s) * scale, dtype) for k, s in shapes.items()}


def mlp(rng, dtype=np.float32, d=5, h=4, batch=6):
    params = _init(rng, {"w1": (d, h), "b1": (h,), "w2": (h, 3), "b2": (3,)}, dtype)

    def loss(p, x):
        y = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return jnp.sum(y**2)

    x = jnp.asarray(rng.normal(size=(batch, d)), dtype)
    return loss, params, x


def sequence(rng, dtype=np.float32, t=3, d=4, heads=2, k=3, batch=5):
    """Dense layers over a sequence, an einsum with a head axis shared with its weight (a
    `dot_general` batch dimension), LayerNorm's scale and bias, and a nested `jit`."""
    shapes = {
        "wq": (heads, d, k),
        "wo": (heads, k, d),
        "dense": (d, d),
        "scale": (d,),
        "bias": (d,),
    }
    params = _init(rng, shapes, dtype)

    def loss(p, x):
        q = jnp.einsum("btd,hdk->bhtk", x, p["wq"])  # weight with no batch dims
        y = jnp.einsum("bhtk,hkd->bhtd", jax.nn.relu(q), p["wo"])  # ...and a head batch dim
        y = jnp.sum(y, axis=1)
        y = jax.jit(lambda a, w: a @ w)(y, p["dense"])
        mean = jnp.mean(y, axis=-1, keepdims=True)
        y = (y - mean) * p["scale"] + p["bias"]
        return jnp.sum(jnp.sin(y))

    x = jnp.asarray(rng.normal(size=(batch, t, d)), dtype)
    return loss, params, x


def embedding(rng, dtype=np.float32, vocab=7, d=4, t=5, batch=6, tied=False):
    """An embedding lookup (repeated tokens in each example), a dense layer, and an output
    projection by the embedding itself (`tied`) or by its own matrix."""
    shapes = {"embed": (vocab, d), "w": (d, d)}
    if not tied:
        shapes["out"] = (vocab, d)
    params = _init(rng, shapes, dtype)

    def loss(p, ids):
        h = jnp.tanh(jnp.take(p["embed"], ids, axis=0) @ p["w"])
        logits = h @ (p["embed"] if tied else p["out"]).T
        return jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(ids, vocab, dtype=h.dtype))

    ids = jnp.asarray(rng.integers(0, vocab, size=(batch, t)))
    return loss, params, ids


def fallback(rng, dtype=np.float32, d=3, batch=4):
    """Parameters used by operations with no closed form: ``sin(w) @ x``, ``w ** 2``, and a
    dense weight also used elementwise (its cross term needs the materialised gradient)."""
    params = _init(rng, {"w": (d, d), "v": (d, d), "u": (d,)}, dtype)

    def loss(p, x):
        y = x @ jnp.sin(p["w"]) + x @ p["v"]
        return jnp.sum(jnp.cos(y)) + 0.1 * jnp.sum(p["w"] ** 2) + jnp.sum(p["v"] * y[0, 0])

    x = jnp.asarray(rng.normal(size=(batch, d)), dtype)
    return loss, params, x


def scanned(rng, dtype=np.float32, layers=3, d=4, t=2, batch=4, remat=False):
    """Stacked blocks under `lax.scan` (a residual dense layer each), optionally
    rematerialised."""
    params = _init(rng, {"w": (layers, d, d), "b": (layers, d), "head": (d,)}, dtype)

    def block(h, wb):
        w, b = wb
        return h + jnp.tanh(h @ w + b), None

    def loss(p, x):
        step = jax.checkpoint(block) if remat else block
        h, _ = jax.lax.scan(step, x, (p["w"], p["b"]))
        return jnp.sum(h @ p["head"])

    x = jnp.asarray(rng.normal(size=(batch, t, d)), dtype)
    return loss, params, x


def unrolled(rng, dtype=np.float32, layers=2, d=4, t=3, batch=4):
    """`layers` dense layers with biases over a sequence of `t` rows, a Python loop (unrolled,
    as Flax without `nn.scan`, Equinox lists and Haiku write them)."""
    params = _init(rng, {f"w{i}": (d, d) for i in range(layers)}, dtype)
    params.update(_init(rng, {f"b{i}": (d,) for i in range(layers)}, dtype))

    def loss(p, x):
        for i in range(layers):
            x = jnp.tanh(x @ p[f"w{i}"] + p[f"b{i}"])
        return jnp.sum(x**2)

    x = jnp.asarray(rng.normal(size=(batch, t, d)), dtype)
    return loss, params, x


def reference(loss, params, batch, clip, padding=None, argnums=0):
    """Float64 per-example gradients (`jax.vmap(jax.grad)` under x64), their norms and the
    sum of the clipped gradients, as NumPy float64 (`per_example_grads`, `reference_from`)."""
    return reference_from(per_example_grads(loss, params, batch, argnums), clip, padding)


def per_example_grads(loss, params, batch, argnums=0):
    """Float64 per-example gradients (`jax.vmap(jax.grad)` under x64) as NumPy: what
    `reference_from` needs, computed once for a model's every check. (Jitted: one program,
    where an eager vmap compiles one per operation.)"""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)
        b64 = (
            jnp.asarray(np.asarray(batch, np.float64))
            if jnp.issubdtype(batch.dtype, jnp.floating)
            else jnp.asarray(batch)
        )
        grads = jax.jit(jax.vmap(jax.grad(loss, argnums), in_axes=(None, 0)))(p64, b64[:, None])
        return jax.tree.map(np.asarray, grads)


def reference_from(grads, clip, padding=None, magnitude=1.0, keep=None):
    """`reference`'s norms and clipped sums from `per_example_grads`'s float64 gradients: of
    the loss times `magnitude` (each gradient times it, in float64), of the examples `keep`
    (indices; all if None) only."""
    if keep is not None:
        grads = jax.tree.map(lambda g: g[np.asarray(keep)], grads)
    grads = jax.tree.map(lambda g: g * np.float64(magnitude), grads)
    leaves, treedef = jax.tree.flatten(grads)
    norms = np.sqrt(sum(np.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in leaves))
    scales = np.where(norms > clip, clip / np.where(norms > 0, norms, 1), 1.0)
    if padding is not None:
        scales = np.where(padding, 0.0, scales)
    sums = [np.tensordot(scales, g, axes=(0, 0)) for g in leaves]
    return norms, jax.tree.unflatten(treedef, sums)


def gru(rng, dtype=np.float32, d=3, h=4, t=5, batch=4):
    """A GRU cell as Equinox writes it (``W @ x`` per step, each product split into three
    gates, two of them added) under `lax.scan`: its state product's output gradient is two
    pieces of its input product's tap beside a tap of its own (`_pieces`)."""
    params = _init(rng, {"w": (3 * h, d), "u": (3 * h, h), "b": (3 * h,), "head": (h, 2)}, dtype)

    def loss(p, x):  # x: (1, t, d)
        def cell(hidden, xt):
            i_r, i_z, i_n = jnp.split(p["w"] @ xt + p["b"], 3)
            h_r, h_z, h_n = jnp.split(p["u"] @ hidden, 3)
            r, z = jax.nn.sigmoid(i_r + h_r), jax.nn.sigmoid(i_z + h_z)
            new = (1 - z) * jnp.tanh(i_n + r * h_n) + z * hidden
            return new, new

        _, hs = jax.lax.scan(cell, jnp.zeros((h,), x.dtype), x[0])
        return jnp.sum(jnp.sin(hs @ p["head"]))

    x = jnp.asarray(rng.normal(size=(batch, t, d)), dtype)
    return loss, params, x


def recurrent(rng, dtype=np.float32, d=3, t=4, batch=4):
    """A recurrent cell under `lax.scan` (its weights the same at every step), one of them also
    used outside the scan (cross terms across the steps and the outside use), a nested scan,
    and a `lax.cond` on a parameter (materialised)."""
    params = _init(rng, {"w": (d, d), "u": (d, d), "v": (2, d, d), "c": (d,)}, dtype)

    def loss(p, x):
        def cell(h, xt):
            def inner(g, v):
                return jnp.tanh(g @ v), None

            g, _ = jax.lax.scan(inner, h @ p["w"], p["v"])
            return g + jnp.tanh(xt @ p["u"]), None

        h, _ = jax.lax.scan(cell, jnp.zeros((1, d), x.dtype), jnp.swapaxes(x, 0, 1))
        h = jax.lax.cond(jnp.sum(h) > 0, lambda a: a * p["c"], lambda a: a - p["c"], h)
        return jnp.sum(jnp.sin(h @ p["w"]))

    x = jnp.asarray(rng.normal(size=(batch, t, d)), dtype)
    return loss, params, x


def nested_constants(rng, dtype=np.float32, batch=4):
    """A convolution kernel and a dense weight the same at every step of two nested scans, and
    a weight the inner scan slices (the same at every step of the outer one): each weight's
    sum is over every step's rows."""
    params = _init(rng, {"k": (3, 3, 2, 2), "u": (2, 2), "v": (3, 2, 2)}, dtype)
    dn = ("NHWC", "HWIO", "NHWC")

    def loss(p, x):
        def inner(g, v):
            g = jnp.tanh(
                jax.lax.conv_general_dilated(g, p["k"], (1, 1), "SAME", dimension_numbers=dn)
            )
            return jnp.tanh(g @ p["u"] + g @ v), None

        def outer(h, _):
            return jax.lax.scan(inner, h, p["v"])[0], None

        h, _ = jax.lax.scan(outer, x, None, length=2)
        return jnp.sum(h**2)

    return loss, params, jnp.asarray(rng.normal(size=(batch, 5, 4, 2)), dtype)


def sliced(rng, dtype=np.float32, d=3, batch=4):
    """One stacked leaf used through single indices: rows 0 and 1 (orthogonal, no cross
    term), row 0 twice (a cross term); another through a range (materialised)."""
    params = _init(rng, {"w": (3, d, d), "r": (4, d)}, dtype)

    def loss(p, x):
        h = jnp.tanh(x @ p["w"][0]) @ p["w"][1]
        h = jnp.sin(h @ p["w"][0].T)
        return jnp.sum(h * jnp.sum(p["r"][1:3], axis=0))

    x = jnp.asarray(rng.normal(size=(batch, d)), dtype)
    return loss, params, x


def transformer(rng, dtype=np.float32, d=8, t=4, vocab=9, blocks=2, heads=2, batch=3):
    """Scanned pre-norm blocks (multi-head attention from a stacked q/k/v weight indexed per
    use, an MLP, RMSNorm scales) between tied embeddings: the benchmark's model, small."""
    e = d // heads
    shapes = {
        "embed": (vocab, d),
        "qkv": (blocks, 3, heads, d, e),
        "o": (blocks, heads, e, d),
        "up": (blocks, d, 2 * d),
        "down": (blocks, 2 * d, d),
        "scale": (blocks, 2, d),
    }
    params = _init(rng, shapes, dtype)

    def norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g

    def block(h, p):
        qkv, o, up, down, scale = p
        a = norm(h, scale[0])
        q, k, v = (jnp.einsum("btd,hde->bhte", a, qkv[i]) for i in range(3))
        att = jax.nn.softmax(jnp.einsum("bhte,bhse->bhts", q, k), -1)
        h = h + jnp.einsum("bhte,hed->btd", jnp.einsum("bhts,bhse->bhte", att, v), o)
        return h + jax.nn.gelu(norm(h, scale[1]) @ up) @ down, None

    def loss(p, ids):
        h = jnp.take(p["embed"], ids, axis=0)
        h, _ = jax.lax.scan(block, h, (p["qkv"], p["o"], p["up"], p["down"], p["scale"]))
        logp = jax.nn.log_softmax(h @ p["embed"].T)
        return -jnp.sum(jnp.take_along_axis(logp, ids[..., None], -1))

    ids = jnp.asarray(rng.integers(0, vocab, size=(batch, t)))
    return loss, params, ids


def conv(rng, dtype=np.float32, batch=3):
    """Flax-like convolutions (NHWC, HWIO): strided with padding, dilated, and a 1-D one with
    another layout, then a dense head."""
    shapes = {"k1": (3, 3, 2, 4), "k2": (2, 2, 4, 3), "k3": (2, 3, 3), "head": (3,)}
    params = _init(rng, shapes, dtype)

    def loss(p, x):
        dn = ("NHWC", "HWIO", "NHWC")
        h = jax.lax.conv_general_dilated(x, p["k1"], (2, 1), ((1, 1), (0, 2)), dimension_numbers=dn)
        h = jax.lax.conv_general_dilated(
            jnp.tanh(h), p["k2"], (1, 1), "SAME", rhs_dilation=(2, 1), dimension_numbers=dn
        )
        seq = jnp.mean(h, axis=1)  # (1, W, 3)
        out = jax.lax.conv_general_dilated(
            jnp.transpose(seq, (0, 2, 1)),
            p["k3"],
            (1,),
            "VALID",
            dimension_numbers=("NCH", "OIH", "NCH"),
        )
        return jnp.sum(jnp.sin(out)) + jnp.sum(h @ p["head"])

    x = jnp.asarray(rng.normal(size=(batch, 7, 6, 2)), dtype)
    return loss, params, x


def conv_shared(rng, dtype=np.float32, batch=3, layers=2):
    """Convolutions beyond one kernel per layer: a depthwise one (a group per input feature,
    two outputs each), a grouped one (two groups), a kernel used twice (a second time
    dilated), and stacked kernels under a rematerialised `lax.scan` (one per block, grouped),
    then a dense head."""
    shapes = {
        "depthwise": (3, 3, 1, 4),
        "grouped": (2, 2, 2, 4),
        "twice": (3, 2, 4, 4),
        "stacked": (layers, 2, 2, 2, 4),
        "head": (4,),
    }
    params = _init(rng, shapes, dtype)
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(h, k, groups=1, **kwargs):
        return jax.lax.conv_general_dilated(
            h, k, (1, 1), "SAME", dimension_numbers=dn, feature_group_count=groups, **kwargs
        )

    def block(h, k):
        return h + jnp.tanh(conv(h, k, 2)), None

    def loss(p, x):
        h = jnp.tanh(conv(x, p["depthwise"], 2))
        h = jnp.tanh(conv(h, p["grouped"], 2))
        h = jnp.tanh(conv(h, p["twice"])) + conv(h, p["twice"], rhs_dilation=(2, 1))
        h, _ = jax.lax.scan(jax.checkpoint(block), h, p["stacked"])
        return jnp.sum(jnp.sin(h @ p["head"]))

    x = jnp.asarray(rng.normal(size=(batch, 5, 4, 2)), dtype)
    return loss, params, x


def take_gpu_branches(patch):
    """Every `lax.platform_dependent` traced while `patch` (a pytest `MonkeyPatch`) holds takes
    its default branch, the GPU's: what a GPU runs, traced and run on this machine."""
    patch.setattr(lax, "platform_dependent", lambda *a, default, **_: default(*a))


def assert_as_vmap_to_bfloat16_rounding(loss, params, batch, clip, mode="jit", noise=()):
    """`clipped_grad`'s norms and sums on a model computed in bfloat16 against
    `method="vmap"`'s. vmap rounds each example's gradient ``g`` to bfloat16 (unit roundoff
    ``u = 2**-8``); the ghost norm is that of ``g`` before its rounding. So: the norms within
    ``u``, and each entry of the sums within ``2u`` of ``sum_b f_b |g_b|`` (``f_b`` the
    factors, whose error is the norms') plus ``2u`` of the sum (its own rounding). Within
    ``2u`` of the whole sum's largest entry instead: a leaf used more than once (vmap rounds
    each use's part before adding them: its error is relative to the parts, which may
    cancel), and a leaf in `noise` (paths as `jax.tree_util.keystr` writes them), whose
    gradient is zero but for rounding (attention's key bias: softmax ignores a shift).
    Examples whose vmap norm is not finite must be dropped by both. The bounds take the
    layers' output gradients to round alike in the batched pass and in vmap's, and an entry's
    terms not to cancel: the clipped sums weight a bfloat16 side by the factor, rounded to
    bfloat16 (`_sums._times`), where vmap rounds the terms' sum, so where the terms cancel
    the two differ by ``u`` of the terms."""
    assert_as_vmap_to_bfloat16_rounding_on_each(loss, params, [batch], clip, mode, noise)


def assert_as_vmap_to_bfloat16_rounding_on_each(loss, params, batches, clip, mode="jit", noise=()):
    """`assert_as_vmap_to_bfloat16_rounding` on each of `batches` (of one shape), with one
    program for each method for them all. Returns the ghost step, its threshold an argument
    (``step(params, batch, threshold)``), for the caller's checks at other thresholds."""
    steps = {}
    for method in ("auto", "vmap"):
        g = lambda p, x, c, method=method: optclip.clipped_grad(  # noqa: E731
            loss, l2_clip_norm=c, return_grad_norms=True, method=method
        )(p, x)
        steps[method] = jax.jit(g) if mode == "jit" else g
    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))
    for batch in batches:
        results = {m: step(params, batch, np.float32(clip)) for m, step in steps.items()}
        (sums, aux), (ref_sums, ref_aux) = results["auto"], results["vmap"]
        norms, ref_norms = (np.asarray(a.grad_norms, np.float64) for a in (aux, ref_aux))
        kept = np.isfinite(ref_norms)
        np.testing.assert_array_equal(np.isfinite(norms), kept)
        u = 2.0**-8
        np.testing.assert_allclose(norms[kept], ref_norms[kept], rtol=u)
        grads = per_example(params, batch[:, None])
        factors = np.minimum(1.0, clip / np.maximum(ref_norms[kept], 1e-300))
        largest = max(np.max(np.abs(np.asarray(e, np.float64))) for e in jax.tree.leaves(ref_sums))
        paths = [
            jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(sums)
        ]
        assert set(noise) <= set(paths), (noise, paths)
        report = optclip.ghost_report(loss, params, batch)
        loose = {*noise, *(path for path in paths if len(report[path].operations) > 1)}
        leaves = zip(paths, *map(jax.tree.leaves, (sums, ref_sums, grads)), strict=True)
        for path, got, expected, g in leaves:
            assert got.dtype == expected.dtype
            got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
            spread = np.tensordot(factors, np.abs(np.asarray(g, np.float64)[kept]), axes=(0, 0))
            bound = 2 * u * (largest if path in loose else spread + np.abs(expected))
            off = np.abs(got - expected) > bound
            assert not np.any(off), (
                f"{path}: {got[off]} against {expected[off]}, bound {bound[off]}"
            )
    return steps["auto"]


def assert_tree_close(actual, expected, rtol=RTOL, whole=False):
    """Every leaf within `rtol` of its largest entry (of the whole tree's, with `whole`)."""
    largest = max(np.max(np.abs(e), initial=0) for e in jax.tree.leaves(expected))
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a = np.asarray(a, np.float64)
        assert a.shape == np.shape(e), (a.shape, np.shape(e))
        scale = max(largest if whole else np.max(np.abs(e), initial=0), 1e-30)
        np.testing.assert_allclose(a, e, rtol=0, atol=rtol * scale)


def compiled_peak(step, *args) -> int:
    """The bytes XLA's memory analysis gives the jitted `step` on `args`: its arguments,
    outputs and temporaries, less what its outputs alias."""
    m = jax.jit(step).lower(*args).compile().memory_analysis()
    used = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return used - m.alias_size_in_bytes
