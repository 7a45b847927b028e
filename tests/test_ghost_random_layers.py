"""Random convolutions and random dense products (`dot_general`) by a weight, against the
float64 reference: every arrangement hypothesis finds of the layouts, strides, paddings,
dilations and feature groups of a convolution (its kernel used once, twice or in a scan),
and of the contracted, head (batch) and free dimensions of a dense layer, the weight on
either side, used once or twice, in a scan or not, its inputs at 1e18 or 1e-18 (their
squares within a few powers of ten of float32's largest and smallest normal numbers); and
random lookups, ids out of range at either end.
(`test_ghost.py`'s random models cover embeddings, stacked dense layers and scales; its fixed
models, one arrangement of each.) ``OPTCLIP_RANDOM_EXAMPLES=400`` draws 400 examples per test
where a run draws 8 (docs/design/ghost-numerics.md: how many were searched)."""

import math
import os

import ghost_models as gm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ghost_models import RTOL
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from jax import lax

import optclip
from optclip.per_example.ghost import _convs, _norms

SPATIAL = "HWD"
EXAMPLES = int(os.environ.get("OPTCLIP_RANDOM_EXAMPLES", "8"))


def check(loss, params, x, clip, leaf):
    """`clipped_grad`'s norms and clipped sum, jitted, against float64: each entry within
    `RTOL` (of the norm; of the largest entry of its leaf's sum of the clipped gradients'
    magnitudes, the scale of a sum's rounding: two examples' terms that cancel leave their
    rounding, not 0), or no further than four times ``method="vmap"``'s entry (a model whose
    float32 forward pass rounds away more: a random one may). Returns the mode `leaf` went
    by."""
    grads = gm.per_example_grads(loss, params, x)
    norms, sums = gm.reference_from(grads, clip)
    _, magnitudes = gm.reference_from(jax.tree.map(np.abs, grads), clip)
    out = {}
    for method in ("auto", "vmap"):
        g = optclip.clipped_grad(loss, l2_clip_norm=clip, return_grad_norms=True, method=method)
        grads, aux = jax.jit(g)(params, x)
        out[method] = [aux.grad_norms, *jax.tree.leaves(grads)]
    expected = [norms, *jax.tree.leaves(sums)]
    scales = [norms, *jax.tree.leaves(magnitudes)]
    for i, (got, vmap, e, m) in enumerate(zip(*out.values(), expected, scales, strict=True)):
        got, vmap = np.asarray(got, np.float64), np.asarray(vmap, np.float64)
        largest = np.max(np.abs(m), initial=0)
        bound = RTOL * (np.abs(e) + 0.1 * largest if i == 0 else largest)
        bound = np.maximum(bound, 4 * np.abs(vmap - e))
        off = ~(np.abs(got - e) <= bound)  # (NaN is off)
        what = "norms" if i == 0 else f"sum's leaf {i - 1}"
        assert not np.any(off), f"{what}: {got[off]} against {e[off]} (vmap: {vmap[off]})"
    return optclip.ghost_report(loss, params, x)[leaf].mode


@st.composite
def convolutions(draw):
    """A convolution's arguments: 1 to 3 spatial dimensions, any order of each operand's
    dimensions, strides, paddings (negative ones too), input and kernel dilations, feature
    groups, several images in one example, a second convolution after it or not; the kernel
    used once, twice (the second time with a geometry of its own), or at each step of a scan
    (stacked kernels, or the same one)."""
    nd = draw(st.integers(1, 3))
    spatial = SPATIAL[:nd]
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    return {
        "uses": draw(st.sampled_from(["once", "twice", "stacked", "same"])),
        "again": draw(geometries(nd)),
        "specs": tuple(
            "".join(draw(st.permutations(fixed + spatial))) for fixed in ("NC", "OI", "NC")
        ),
        "cin": draw(st.integers(1, 3)) * groups,
        "cout": draw(st.integers(1, 3)) * groups,
        "groups": groups,
        "size": [draw(st.integers(1, 6 if nd < 3 else 4)) for _ in range(nd)],
        "kernel": [draw(st.integers(1, 3)) for _ in range(nd)],
        **draw(geometries(nd)),
        "images": draw(st.integers(1, 3)),
        "batch": draw(st.integers(1, 4)),
        "second": draw(st.booleans()),
        "clip": draw(st.sampled_from([0.1, 1.0, 1e30])),
        "seed": draw(st.integers(0, 2**31)),
    }


@st.composite
def geometries(draw, nd):
    """A convolution's strides, paddings (negative ones too), input and kernel dilations."""
    return {
        "strides": [draw(st.integers(1, 3)) for _ in range(nd)],
        "padding": [(draw(st.integers(-1, 3)), draw(st.integers(-1, 3))) for _ in range(nd)],
        "lhs_dilation": [draw(st.sampled_from([1, 1, 2])) for _ in range(nd)],
        "rhs_dilation": [draw(st.sampled_from([1, 1, 2])) for _ in range(nd)],
    }


def convolve(c, h, kernel, geometry=None):
    """The convolution `c` of images `h` laid out ``(N, C, *spatial)``, by `kernel`, with the
    strides, paddings and dilations of `geometry` (by default `c`'s)."""
    lhs, rhs, out = c["specs"]
    g = geometry or c
    spatial = SPATIAL[: len(c["size"])]
    h = jnp.transpose(h, ["NC".find(d) if d in "NC" else 2 + spatial.index(d) for d in lhs])
    return lax.conv_general_dilated(
        h,
        kernel,
        g["strides"],
        g["padding"],
        g["lhs_dilation"],
        g["rhs_dilation"],
        (lhs, rhs, out),
        c["groups"],
    )


def convolution_model(c):
    """``loss(params, x)``: the convolution `c` (its kernel held in its own layout), a bias,
    tanh, then a 1x1 convolution by a second kernel (`second`), for examples of `images`
    images laid out ``(C, *spatial)``. With `uses` ``"twice"``, the kernel also convolves the
    images' cosines with the geometry `again`; ``"stacked"``: two kernels, each convolving
    the images times its own number at a step of a scan; ``"same"``: the kernel at each of
    the scan's two steps."""
    rng = np.random.default_rng(c["seed"])
    lhs, rhs, out = c["specs"]
    spatial = SPATIAL[: len(c["size"])]
    sizes = {"O": c["cout"], "I": c["cin"] // c["groups"], **dict(zip(spatial, c["kernel"]))}
    kernel = [sizes[d] for d in rhs]
    if c["uses"] == "stacked":
        kernel = [2, *kernel]
    params = {
        "k": jnp.asarray(rng.normal(size=kernel) * 0.5, jnp.float32),
        "b": jnp.asarray(rng.normal(size=(c["cout"],)), jnp.float32),
    }
    if c["second"]:
        ones = {"O": 2, "I": c["cout"], **dict.fromkeys(spatial, 1)}
        params["k2"] = jnp.asarray(rng.normal(size=[ones[d] for d in rhs]), jnp.float32)
    shape = (c["batch"], c["images"], c["cin"], *c["size"])
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)

    def weighted(y):
        return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    def layer(p, h, kernel):
        y = convolve(c, h, kernel)
        bias = jnp.expand_dims(p["b"], [i for i, d in enumerate(out) if d != "C"])
        y = jnp.tanh(y + bias)
        if c["second"]:
            y = jnp.transpose(y, [out.index(d) for d in lhs])
            y = lax.conv_general_dilated(
                y, p["k2"], [1] * len(spatial), "SAME", dimension_numbers=(lhs, rhs, out)
            )
        return weighted(y)

    def loss(p, x):
        h = x[0]
        if c["uses"] == "stacked":
            step = lambda total, ks: (total + layer(p, h * ks[1], ks[0]), None)  # noqa: E731
            return lax.scan(step, jnp.zeros((), h.dtype), (p["k"], jnp.array([1.0, -0.5])))[0]
        if c["uses"] == "same":
            step = lambda total, s: (total + layer(p, h * s, p["k"]), None)  # noqa: E731
            return lax.scan(step, jnp.zeros((), h.dtype), jnp.array([1.0, -0.5]))[0]
        total = layer(p, h, p["k"])
        if c["uses"] == "twice":
            total = total + weighted(convolve(c, jnp.cos(h), p["k"], c["again"]))
        return total

    return loss, params, x


def conv_case(**changes):
    """A hypothesis `example`: a 2-D convolution, NHWC and HWIO, changed by `changes`."""
    geometry = {
        "strides": [1, 1],
        "padding": [(1, 1), (0, 0)],
        "lhs_dilation": [1, 1],
        "rhs_dilation": [1, 1],
    }
    case = {
        "uses": "once",
        "again": geometry,
        "specs": ("NHWC", "HWIO", "NHWC"),
        "cin": 2,
        "cout": 3,
        "groups": 1,
        "size": [5, 4],
        "kernel": [3, 2],
        **geometry,
        "images": 2,
        "batch": 3,
        "second": False,
        "clip": 0.1,
        "seed": 5,
    }
    return example(case | changes)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3).flatmap(
        lambda nd: st.tuples(
            *(
                st.lists(st.integers(lo, hi), min_size=nd, max_size=nd)
                for lo, hi in [(1, 6), (1, 3), (1, 2), (-1, 2), (-1, 2), (1, 2), (1, 2)]
            )
        )
    )
)
def test_patches_are_the_entries_of_jax_patches(geometry):
    """`_convs.patches`, slices of the padded input, against
    ``lax.conv_general_dilated_patches`` (an identity kernel's convolution): the same entries
    in the same order, every geometry (strides, negative padding, dilated input and window, an
    output of no entries), 1 to 3 spatial dimensions."""
    size, window, strides, low, high, lhs_dilation, rhs_dilation = geometry
    padding = list(zip(low, high, strict=True))
    x = np.random.default_rng(0).standard_normal((2, 3, *size)).astype(np.float32)
    args = (window, strides, padding, lhs_dilation, rhs_dilation)
    try:
        want = lax.conv_general_dilated_patches(x, *args, precision=lax.Precision.HIGHEST)
    except (ValueError, TypeError):  # (JAX refuses it: a padding past the input)
        assume(False)
    got = _convs.patches(jnp.asarray(x), 2, *args)  # (N, C, window, *out spatial)
    assert got.shape == (2, 3, math.prod(window), *want.shape[2:])
    np.testing.assert_array_equal(got.reshape(want.shape), want)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(convolutions())
# (a negative padding larger than the input: JAX refuses it, no example)
@conv_case(size=[1, 1], kernel=[1, 1], padding=[(0, 0), (-1, -1)])
# (an output of no entries: the kernel wider than its input)
@conv_case(size=[1, 1], kernel=[1, 2], padding=[(0, 0), (0, 0)])
# (a transposed convolution: the input dilated; strides; a negative padding)
@conv_case(lhs_dilation=[2, 1], strides=[2, 3], padding=[(-1, 2), (2, 0)])
# (grouped; then a second kernel after it)
@conv_case(groups=2, cin=4, cout=4, second=True)
# (depthwise, used twice: the second time strided and dilated, with a negative padding)
@conv_case(
    groups=2,
    cin=2,
    cout=4,
    uses="twice",
    again={
        "strides": [2, 1],
        "padding": [(-1, 1), (2, 0)],
        "lhs_dilation": [1, 2],
        "rhs_dilation": [2, 1],
    },
)
# (stacked kernels under a scan, grouped; the same kernel at every step)
@conv_case(groups=3, cin=3, cout=6, uses="stacked", clip=1.0)
@conv_case(uses="same", kernel=[2, 2], padding=[(0, 0), (1, 0)])
# (3-D, every operand in its own order of dimensions)
@conv_case(
    specs=("DCNWH", "WHDIO", "HNDWC"),
    size=[3, 4, 2],
    kernel=[2, 1, 2],
    strides=[1, 2, 1],
    padding=[(0, 1), (1, 0), (0, 0)],
    lhs_dilation=[1, 1, 1],
    rhs_dilation=[2, 1, 1],
    clip=1e30,
)
def test_random_convolutions_match_the_float64_reference(c):
    loss, params, x = convolution_model(c)
    kernel = params["k"][0] if c["uses"] == "stacked" else params["k"]
    geometries = [None, c["again"]] if c["uses"] == "twice" else [None]
    try:
        outs = [
            jax.eval_shape(lambda h, k, g=g: convolve(c, h, k, g), x[0], kernel) for g in geometries
        ]
    except ValueError:  # (JAX refuses it: a negative padding larger than the input)
        assume(False)
    mode = check(loss, params, x, c["clip"], "['k']")
    # (an output of no entries: no gradient reaches the kernel by that use)
    assert mode == ("unused" if all(o.size == 0 for o in outs) else "ghost"), c


@st.composite
def products(draw):
    """A dense product's arguments: the weight's dimensions (contracted with the input, heads
    shared with it, free) and the input's (contracted, heads, free: a sequence) in any order,
    the weight on either side of `dot_general`, used once or twice (a cross term), in a scan
    (a weight per step, or the same weight at every step) or not, viewed (scaled, negated,
    transposed and back) or not, with inputs at 1, 1e18 or 1e-18 and output gradients at the
    inverse."""
    names = {
        "c": draw(st.integers(1, 2)),
        "h": draw(st.integers(0, 2)),
        "o": draw(st.integers(0, 2)),
        "t": draw(st.integers(0, 2)),
    }
    most = {"c": 4, "h": 3, "o": 4, "t": 6}
    sizes = {f"{k}{i}": draw(st.integers(1, most[k])) for k, n in names.items() for i in range(n)}
    return {
        "sizes": sizes,
        "weight": list(draw(st.permutations([d for d in sizes if d[0] in "cho"]))),
        "input": list(draw(st.permutations([d for d in sizes if d[0] in "cht"]))),
        "weight_first": draw(st.booleans()),
        "twice": draw(st.booleans()),
        "scan": draw(st.sampled_from([None, "stacked", "same"])),
        "view": draw(st.sampled_from(["none", "scaled", "negated", "transposed"])),
        "batch": draw(st.integers(1, 4)),
        "magnitude": draw(st.sampled_from([1.0, 1e18, 1e-18])),
        "clip": draw(st.sampled_from([0.1, 1.0, 1e30])),
        "looped": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


def product_model(c):
    """``loss(params, x)``: the product `c`, then sin; a second use of the weight on another
    input (`twice`); steps of a scan over stacked weights (``"stacked"``: then each product
    takes a weight of the stack) or by the same weight (``"same"``)."""
    rng = np.random.default_rng(c["seed"])
    sizes, wd, xd, m = c["sizes"], c["weight"], c["input"], c["magnitude"]
    layers = 3 if c["scan"] == "stacked" else None
    shape = [sizes[d] for d in wd]
    w = rng.normal(size=[layers, *shape] if layers else shape) * 0.5
    params = {"w": jnp.asarray(w, jnp.float32)}
    x = jnp.asarray(rng.normal(size=[c["batch"]] + [sizes[d] for d in xd]) * m, jnp.float32)
    other = jnp.asarray(rng.normal(size=[sizes[d] for d in xd]) * m, jnp.float32)
    contract = [d for d in wd if d[0] == "c"]
    heads = [d for d in wd if d[0] == "h"]
    on_w = ([wd.index(d) for d in contract], [wd.index(d) for d in heads])
    on_x = ([xd.index(d) for d in contract], [xd.index(d) for d in heads])
    views = {
        "none": lambda v: v,
        "scaled": lambda v: v * 0.5,
        "negated": lambda v: -v,
        "transposed": lambda v: jnp.transpose(jnp.transpose(v)),
    }

    def product(v, h):  # (divided by the magnitude: output gradients at its inverse)
        v = views[c["view"]](v)
        if c["weight_first"]:
            return lax.dot_general(v, h, ((on_w[0], on_x[0]), (on_w[1], on_x[1]))) / m
        return lax.dot_general(h, v, ((on_x[0], on_w[0]), (on_x[1], on_w[1]))) / m

    def weighted(y):
        return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    def loss(p, x):
        h = x[0]
        if c["scan"] == "stacked":
            step = lambda total, v: (total + weighted(product(v, h)), None)  # noqa: E731
            total = lax.scan(step, jnp.zeros((), h.dtype), p["w"])[0]
            if c["twice"]:
                step = lambda total, v: (total + weighted(product(v, other)) ** 2, None)  # noqa: E731
                total = total + lax.scan(step, jnp.zeros((), h.dtype), p["w"])[0]
            return total
        total = weighted(product(p["w"], h))
        if c["twice"]:
            total = total + jnp.sum(jnp.tanh(product(p["w"], h * 0.5 + other)) ** 2)
        if c["scan"] == "same":
            inputs = jnp.stack([h, other, h * 2])
            step = lambda total, u: (total + weighted(product(p["w"], u)), None)  # noqa: E731
            total = total + lax.scan(step, jnp.zeros((), h.dtype), inputs)[0]
        return total

    return loss, params, x


def product_case(**changes):
    """A hypothesis `example`: ``x @ w`` over a sequence, changed by `changes`."""
    case = {
        "sizes": {"c0": 3, "o0": 2, "t0": 4},
        "weight": ["c0", "o0"],
        "input": ["t0", "c0"],
        "weight_first": False,
        "twice": False,
        "scan": None,
        "view": "none",
        "batch": 3,
        "magnitude": 1.0,
        "clip": 0.1,
        "looped": False,
        "seed": 3,
    }
    return example(case | changes)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(products())
# (heads shared by the weight and the input, two contracted dimensions, the weight first,
# used twice, inputs at 1e18)
@product_case(
    sizes={"c0": 2, "c1": 3, "h0": 2, "o0": 2, "t0": 3},
    weight=["o0", "c1", "h0", "c0"],
    input=["c0", "h0", "t0", "c1"],
    weight_first=True,
    twice=True,
    magnitude=1e18,
)
# (stacked weights in a scan, used twice, negated; the norms one example at a time)
@product_case(scan="stacked", twice=True, view="negated", looped=True, magnitude=1e-18)
# (the same weight at every step of a scan and outside it, scaled)
@product_case(scan="same", twice=True, view="scaled", clip=1e30)
# (two examples' clipped gradients that cancel to 1e-17 of each: their float32 rounding,
# 1 ulp of 0.1, is left)
@product_case(sizes={"c0": 1}, weight=["c0"], input=["c0"], batch=2, magnitude=1e18, seed=0)
def test_random_dense_products_match_the_float64_reference(c):
    loop_work = _norms.LOOP_WORK
    _norms.LOOP_WORK = 0 if c["looped"] else loop_work  # (the norms one example at a time)
    try:
        assert check(*product_model(c), c["clip"], "['w']") == "ghost", c
    finally:
        _norms.LOOP_WORK = loop_work


LOOKUPS = {  # (ways of looking up rows of a table, each with the mode JAX gives it)
    "index": lambda t, ids: t[ids],  # (a promise that ids are in range; -1 counts from the end)
    "clip": lambda t, ids: jnp.take(t, ids, axis=0, mode="clip"),
    "fill": lambda t, ids: t.at[ids].get(mode="fill", fill_value=0),
    "wrap": lambda t, ids: jnp.take(t, ids, axis=0, mode="wrap"),
    "vmapped": lambda t, ids: jax.vmap(lambda i: t[i])(ids),  # (Equinox's)
    "columns": lambda t, ids: jnp.take(t.T, ids, axis=1, mode="fill", fill_value=0).T,
}


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    way=st.sampled_from(list(LOOKUPS)),
    vocab=st.integers(1, 6),
    length=st.integers(1, 5),
    batch=st.integers(1, 4),
    tied=st.booleans(),
    clip=st.sampled_from([0.1, 1.0, 1e30]),
    seed=st.integers(0, 2**31),
)
@example(way="index", vocab=5, length=4, batch=3, tied=True, clip=0.1, seed=0)
@example(way="fill", vocab=3, length=5, batch=2, tied=False, clip=1.0, seed=1)
def test_random_lookups_match_the_float64_reference(way, vocab, length, batch, tied, clip, seed):
    # Ids from two below -vocab to two above vocab - 1: out of range at either end, negative
    # ones counting from the end (`index`) or not; the table also the output layer (`tied`).
    rng = np.random.default_rng(seed)
    params = {"table": jnp.asarray(rng.normal(size=(vocab, 3)), jnp.float32)}
    if not tied:
        params["out"] = jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32)
    ids = jnp.asarray(rng.integers(-vocab - 2, vocab + 2, size=(batch, length)))

    def loss(p, ids):
        h = jnp.tanh(LOOKUPS[way](p["table"], ids[0]) * 2.0)
        return jnp.sum(jnp.sin(h @ (p["table"].T if tied else p["out"])))

    assert check(loss, params, ids, clip, "['table']") == "ghost"
