"""Records what pytorch-optimizer's `AdaGC` does to a sequence of gradients, for
tests/test_adagc.py (which compares `optclip.adagc` with it without needing PyTorch).

    pip install torch pytorch-optimizer   # recorded with torch 2.13.0+cpu, pytorch-optimizer 4.1.0
    python tests/data/record_adagc_pytorch_optimizer.py

`AdaGC` is an optimizer (Adam with the clip built in). Its clipped gradient is read from the
first moment: with ``betas=(0.0, ...)`` the moment is ``lerp(m, g_hat, 1.0)``, which torch
computes as ``g_hat - (g_hat - m) * 0``: the clipped gradient exactly. ``lr=0`` and
``weight_decay=0``: the parameters never move (the clip does not read them anyway). Everything
in float64, both code paths of the optimizer (``foreach`` off and on) checked to agree.

Two sequences of float32 gradients for three tensors, 40 steps:
- "spikes": a global norm from 1.8 down (the warm-up clips at `lambda_abs` = 1 at first, not at
  the end), then single-tensor and whole-model spikes (x10 to x50), a tensor whose gradient is
  zero for three steps after the warm-up, and one whose norm grows by 2% a step;
- "zero_in_warmup": tensor "c" has a zero gradient at the first step (LoRA's `A` while `B` is
  zero), which sets its gamma to 0 in the reference.
"""

import pathlib

import numpy as np

SHAPES = {"a": (4, 3), "b": (5,), "c": (2, 2)}
STEPS = 40
OPTCLIP_WARMUP = 8  # optclip.adagc(warmup_steps=8) is AdaGC(warmup_steps=9): its test is `<`
CONFIG = dict(lambda_abs=1.0, lambda_rel=1.05, beta=0.98, warmup_steps=OPTCLIP_WARMUP + 1)


def sequence(kind: str, seed: int) -> list:
    rng = np.random.default_rng(seed)
    base = {"a": 1.2, "b": 0.8, "c": 1.0}
    steps = []
    for t in range(STEPS):
        grads = {}
        for name, shape in SHAPES.items():
            g = rng.standard_normal(shape)
            g *= base[name] * np.exp(0.05 * rng.standard_normal()) / np.linalg.norm(g)
            # The norms fall fast early on, then slowly, as in training; "b"'s grow after the
            # warm-up, so that it meets its threshold again and again.
            g *= 0.9 ** min(t, 10) * 0.995 ** max(t - 10, 0)
            if name == "b":
                g *= 1.02 ** max(t - 10, 0)
            grads[name] = g
        if kind == "spikes":
            if t == 13:
                grads["a"] *= 30.0
            if t == 21:
                grads = {k: v * 10.0 for k, v in grads.items()}
            if t in (17, 18, 19):
                grads["c"] = np.zeros(SHAPES["c"])
            if t == 30:
                grads["c"] *= 50.0
        elif kind == "zero_in_warmup":
            if t == 0:
                grads["c"] = np.zeros(SHAPES["c"])
            if t == 25:
                grads["b"] *= 20.0
        steps.append({k: v.astype(np.float32) for k, v in grads.items()})
    return steps


def run_reference(steps, foreach: bool):
    import torch
    from pytorch_optimizer import AdaGC

    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES.values()]
    opt = AdaGC(params, lr=0.0, betas=(0.0, 0.999), weight_decay=0.0, foreach=foreach, **CONFIG)
    clipped, gamma = [], []
    for grads in steps:
        for p, g in zip(params, grads.values()):
            p.grad = torch.tensor(g.astype(np.float64))
        opt.step()
        clipped.append([opt.state[p]["exp_avg"].numpy().copy() for p in params])
        gamma.append([float(opt.state[p]["gamma"]) for p in params])
    return clipped, np.asarray(gamma)


def main() -> None:
    from importlib.metadata import version

    out = {}
    for kind, seed in (("spikes", 11), ("zero_in_warmup", 12)):
        steps = sequence(kind, seed)
        clipped, gamma = run_reference(steps, foreach=False)
        clipped_foreach, gamma_foreach = run_reference(steps, foreach=True)
        for x, y in zip(clipped, clipped_foreach):
            for u, v in zip(x, y):
                np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(gamma, gamma_foreach, rtol=1e-12)
        for name in SHAPES:
            i = list(SHAPES).index(name)
            out[f"{kind}/grads/{name}"] = np.stack([s[name] for s in steps])
            out[f"{kind}/clipped/{name}"] = np.stack([c[i] for c in clipped])
        out[f"{kind}/gamma"] = gamma
    out["versions"] = np.array([version("torch"), version("pytorch-optimizer")])
    out["config"] = np.array([CONFIG[k] for k in ("lambda_abs", "lambda_rel", "beta")])
    out["warmup_steps"] = np.array(CONFIG["warmup_steps"])
    path = pathlib.Path(__file__).with_name("adagc_pytorch_optimizer.npz")
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
