"""The examples and the README: each runs in a quick mode and says what it should."""

import ast
import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240  # generous: the CPU may be shared; each run takes a few seconds alone

# Every example, the arguments of its quick run, and patterns its output must contain.
QUICK_RUNS = {
    "rnn_exploding_gradients.py": (
        ["--steps", "5"],
        [
            r"mode\s+final loss\s+max grad norm\s+steps clipped\s+NaN or inf",
            r"^no clipping\s",
            r"^value_clip\(0\.1\)\s",
            r"^norm_clip\(1\)\s",
            r"^global_clip\(1\)\s",
        ],
    ),
    "data_parallel.py": (["--steps", "5"], [r"every setting clips by the same global norm"]),
    "from_tensorflow.py": (["--steps", "5"], [r"both forms give the same weights"]),
    "from_keras.py": (["--steps", "5"], [r"gives the same weights as the explicit chain"]),
    "from_pytorch.py": (["--steps", "5"], [r"^norm 1 = max_norm 1 .* True +False$"]),
}


def start_example(name, args):
    """Start `examples/name` in a fresh interpreter (optclip as installed: `pip install -e .`)."""
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
    )


@pytest.fixture(scope="module")
def quick_runs():
    """Every example's quick run, all started at once (most of their time is compiling)."""
    runs = {name: start_example(name, args) for name, (args, _) in QUICK_RUNS.items()}
    yield runs
    for run in runs.values():
        if run.poll() is None:
            run.kill()
            run.communicate()


def load_example(name):
    """Import `examples/name` as a module, without running its `main`."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_has_a_quick_run_and_a_docstring():
    names = {p.name for p in EXAMPLES.glob("*.py")}
    assert names == set(QUICK_RUNS)
    for name in names:
        assert ast.get_docstring(ast.parse((EXAMPLES / name).read_text())), name


@pytest.mark.parametrize("name", sorted(QUICK_RUNS))
def test_example_runs(name, quick_runs):
    run = quick_runs[name]
    stdout, stderr = run.communicate(timeout=TIMEOUT_S)
    assert run.returncode == 0, stdout + stderr
    for pattern in QUICK_RUNS[name][1]:
        assert re.search(pattern, stdout, re.MULTILINE), (pattern, stdout)


@pytest.fixture(scope="module")
def demo_runs():
    """The demo's unclipped and global_clip runs, 40 steps each (a few seconds)."""
    demo = load_example("rnn_exploding_gradients.py")
    return demo, {mode: demo.train(mode, steps=40) for mode in ("no clipping", "global_clip")}


def test_demo_explodes_without_clipping_and_not_with_global_clip(demo_runs):
    _, runs = demo_runs
    unclipped, clipped = runs["no clipping"], runs["global_clip"]
    assert unclipped["nan_step"] is not None
    assert unclipped["max_grad_norm"] > 1e6
    assert clipped["nan_step"] is None
    assert clipped["steps_run"] == 40
    assert clipped["max_grad_norm"] < 100
    assert all(math.isfinite(loss) for loss in clipped["losses"])
    assert 0 < clipped["clipped_steps"] < 40


def test_demo_plot(demo_runs, tmp_path):
    pytest.importorskip("matplotlib")
    demo, runs = demo_runs
    path = tmp_path / "curves.png"
    demo.plot(list(runs.values()), path)
    assert path.stat().st_size > 0


def readme_python_blocks():
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def test_readme_has_python_examples():
    assert readme_python_blocks()


@pytest.mark.parametrize("index", range(len(readme_python_blocks())))
def test_readme_python_block_runs(index):
    code = compile(readme_python_blocks()[index], f"README.md block {index}", "exec")
    # As a reader runs it: with JAX's default dtype promotion (optax.adam needs it).
    with jax.numpy_dtype_promotion("standard"):
        exec(code, {})
