"""Float64 NumPy references that every result is compared with."""

import jax
import numpy as np

# Relative tolerance for values rounded once to each dtype.
RTOL = {
    "float16": 2e-3,
    "bfloat16": 1.6e-2,
    "float32": 2e-6,
    "complex64": 2e-6,
    "float64": 1e-12,
    "complex128": 1e-12,
}


def rtol_for(dtype) -> float:
    return RTOL[np.dtype(dtype).name]


def as_f64(x) -> np.ndarray:
    """A leaf's exact values in float64 (complex128 for complex leaves)."""
    x = np.asarray(x)
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def ref_global_norm(leaves, p=2.0) -> float:
    """The float64 NumPy reference for the global p-norm of a list of leaves."""
    flat = np.concatenate([np.abs(as_f64(x)).ravel() for x in leaves] + [np.zeros(0)])
    if p == np.inf:
        return float(flat.max(initial=0.0))
    m = flat.max(initial=0.0)
    if m == 0:
        return 0.0
    return float(m * np.sum((flat / m) ** p) ** (1.0 / p))


def ref_scale(norm, threshold):
    threshold = max(float(threshold), 0.0)
    if not np.isfinite(norm):
        return np.nan
    return 1.0 if norm <= threshold else threshold / norm


def run(fn, mode):
    return fn if mode == "eager" else jax.jit(fn)


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (calls, scans, conds...): what a
    traced step asks the compiler for."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def ref_clip_by_norm(x, clip, axes=None) -> np.ndarray:
    """TensorFlow's clip_by_norm in float64: ``x * c / max(norm, c)`` per slice."""
    x = as_f64(x)
    axes = None if axes is None else tuple(np.atleast_1d(axes))
    norm = np.sqrt(np.sum(np.abs(x) ** 2, axis=axes, keepdims=True))
    clip = max(float(clip), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        scale = np.where(norm > clip, clip / np.where(norm > clip, norm, 1.0), 1.0)
    return x * np.where(np.isfinite(norm), scale, np.nan)


def ref_clip_by_average_norm(x, clip) -> np.ndarray:
    x = as_f64(x)
    average = np.sqrt(np.sum(np.abs(x) ** 2)) / max(x.size, 1)
    return x * ref_scale(average, clip)


def ref_clip_by_global_norm(leaves, clip):
    norm = ref_global_norm(leaves)
    scale = ref_scale(norm, clip)
    return [as_f64(x) * scale for x in leaves], norm


def random_leaves(rng, shapes, dtype, spread=True):
    """Normal leaves of the given shapes, each with its own scale when `spread`."""
    out = []
    for shape in shapes:
        scale = 10.0 ** rng.uniform(-2, 2) if spread else 1.0
        out.append(np.asarray(scale * rng.standard_normal(shape)).astype(dtype))
    return out


def gradient_steps(params, n, seed=0):
    """`n` float32 trees of gradients shaped like `params`, each a few orders of magnitude
    apart (a factor 10**U(-1, 1) per step), as NumPy."""
    rng = np.random.default_rng(seed)
    return [
        {
            k: (rng.standard_normal(np.shape(v)) * 10.0 ** rng.uniform(-1, 1)).astype(np.float32)
            for k, v in params.items()
        }
        for _ in range(n)
    ]


def assert_close(actual, expected, dtype, factor=1.0):
    """Element-wise comparison with a tolerance fitting `dtype`'s rounding."""
    actual = as_f64(actual)
    expected = np.asarray(expected)
    atol = factor * rtol_for(dtype) * max(np.max(np.abs(expected), initial=0.0), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=factor * rtol_for(dtype), atol=atol)


def ref_loss_scales(finite_steps, init, growth=2.0, backoff=0.5, interval=2000, min_scale=1.0):
    """The dynamic loss scale after each step, given whether each step's gradients were finite:
    PyTorch's ``_amp_update_scale_`` (the rule of ``GradScaler.update``) in float32, with jmp's
    lower bound `min_scale` (0: none, as PyTorch)."""
    scale, tracker, out = np.float32(init), 0, []
    for finite in finite_steps:
        if not finite:
            scale, tracker = max(np.float32(scale * np.float32(backoff)), np.float32(min_scale)), 0
        elif tracker + 1 == interval:
            with np.errstate(over="ignore"):
                grown = np.float32(scale * np.float32(growth))
            scale, tracker = (grown if np.isfinite(grown) else scale), 0
        else:
            tracker += 1
        out.append(float(scale))
    return out


def ref_spike_skips(norms, losses, window, k, min_history):
    """Which steps a rolling k-sigma test skips, and each step's norm and loss thresholds, in
    float64: a step is recorded when its norm (and its loss, if given: not None) is finite;
    a spike is above ``mean + k * std`` (sample std) of the last `window` recorded values,
    once `min_history` are recorded; non-finite steps are skipped and not recorded."""
    kept_norms, kept_losses, skips, limits = [], [], [], []

    def limit(values):
        values = [v for v in values[-window:] if v is not None]
        if len(values) < min_history:
            return np.inf
        values = np.asarray(values, np.float64)
        return values.mean() + k * values.std(ddof=1)

    for norm, loss in zip(norms, losses):
        finite = np.isfinite(norm) and (loss is None or np.isfinite(loss))
        norm_limit = limit(kept_norms)
        loss_limit = np.inf if loss is None else limit(kept_losses)
        spike = finite and (norm > norm_limit or (loss is not None and loss > loss_limit))
        if finite:
            kept_norms.append(norm)
            kept_losses.append(loss)
        skips.append(bool(spike or not finite))
        limits.append((norm_limit, loss_limit))
    return skips, limits


def load_benchmark(script: str):
    """`benchmarks/<script>` as a module (its helpers' folders put on `sys.path` as it says)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / script
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (where `dataclasses` looks a class's module up)
    spec.loader.exec_module(module)
    return module
