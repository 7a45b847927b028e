"""The examples: the demo's training runs, plot and printout (in-process), and every example
script in a quick mode (a subprocess each: the slow tier)."""

import ast
import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
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
    "large_model.py": (
        ["--steps", "40", "--spike-at", "32", "--log-every", "10"],
        [
            r"^step +0 .* skipped \(overflow\)$",
            r"^step +32 .* skipped \(spike\)$",
            r"^steps skipped as spikes: 1 \(steps \[32\]\)$",
            r"^  blocks/3 ",
        ],
    ),
    "loss_scaling.py": (
        ["--steps", "40", "--seeds", "1"],
        [r"^float32\s", r"^float16, loss scaling\s", r"^float16, no loss scaling\s"],
    ),
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


@pytest.mark.slow
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


def test_demo_prints_the_recurrent_gradient_growth(demo_runs):
    demo, runs = demo_runs
    norms = runs["no clipping"]["recurrent_grad_norms"]
    assert len(norms) == demo.GROWTH_STEPS
    assert all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert norms[-1] > 1e6 * norms[0]  # many orders of magnitude within five steps
    assert len(runs["global_clip"]["recurrent_grad_norms"]) == demo.GROWTH_STEPS


def test_demo_names_the_machine():
    demo = load_example("rnn_exploding_gradients.py")
    description = demo.machine_description()
    assert demo.cpu_model() in description
    assert f"jax {jax.__version__}" in description
    assert demo.cpu_model().strip()


def test_demo_notes_runs_too_short_to_leave_the_plateau():
    demo = load_example("rnn_exploding_gradients.py")
    assert demo.DEFAULT_STEPS == demo.parse_args([]).steps == 3000
    assert demo.short_run_note(3000) is None
    note = demo.short_run_note(300)
    assert "plateau" in note and "default 3000 steps" in note


def test_demo_plot(demo_runs, tmp_path):
    from matplotlib import image  # the test extra installs matplotlib: never skipped

    demo, runs = demo_runs
    path = tmp_path / "curves.png"
    fig = demo.plot(list(runs.values()), path)
    ax_first, ax_loss, ax_norm = fig.axes
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        bottom, top = ax.get_ylim()
        assert 0 < bottom < top
    # The first panel holds the whole explosion of the unclipped run, loss and gradient norm.
    unclipped = runs["no clipping"]
    assert "inf at step" in ax_first.get_title()
    bottom, top = ax_first.get_ylim()
    values = np.asarray(unclipped["losses"] + unclipped["grad_norms"])
    finite = values[np.isfinite(values)]
    assert bottom <= finite.min() and finite.max() <= top
    # The other two hold every value of the runs that stayed finite; the unclipped run leaves
    # through the top and says so, without stretching the axis.
    for ax, key in ((ax_loss, "losses"), (ax_norm, "grad_norms")):
        bottom, top = ax.get_ylim()
        lines = {line.get_label(): np.asarray(line.get_ydata(), float) for line in ax.get_lines()}
        in_view = [
            y
            for label, y in lines.items()
            if label in ("predict the mean", "global_clip's threshold")
        ]
        for mode, run in runs.items():
            (label,) = [label for label in lines if label.startswith(demo.mode_label(mode))]
            assert np.array_equal(lines[label], np.asarray(run[key]), equal_nan=True)
            finite = lines[label][np.isfinite(lines[label])]
            if run["nan_step"] is None:
                assert bottom <= finite.min() and finite.max() <= top
                in_view.append(finite)
            else:
                assert finite.max() > top and "off the top" in label
        assert top <= 10 * max(y.max() for y in in_view)
    # The saved file is a real image of the figure's size, not a blank one.
    pixels = image.imread(path)
    width, height = demo.FIGSIZE
    assert pixels.shape[:2] == (round(height * demo.DPI), round(width * demo.DPI))
    assert pixels[..., :3].std() > 0.05
