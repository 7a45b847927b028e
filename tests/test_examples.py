"""The examples: the demo's training runs, plot and printout (in-process; those that train, the
slow tier), and every example script in a quick mode (a subprocess each: the slow tier)."""

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

# (the README's figures are of the demo as users run it)
pytestmark = pytest.mark.usefixtures("as_users_compile_module")

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240  # generous: the CPU may be shared; each run takes a few seconds alone

# Every example, the arguments of its quick run, and patterns its output must contain.
QUICK_RUNS = {
    "rnn_exploding_gradients.py": (
        ["--steps", "5", "--seeds", "2"],
        [
            r"^\s+solved\s+final loss\s+max grad norm\s+steps clipped\s+NaN or inf$",
            r"^mode\s+\(<0\.01\)\s+median\s+\[min, max\]\s+median\s+max\s+median\s+seeds",
            r"^no clipping\s+0/2\s",
            r"^value_clip\(0\.1\)\s+0/2\s.*\s0/2\s+-$",
            r"^norm_clip\(1\)\s+0/2\s.*\s0/2\s+-$",
            r"^global_clip\(1\)\s+0/2\s.*\s0/2\s+-$",
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
    "private_training.py": (
        ["--steps", "20"],
        [r"^\['embed'\] +ghost ", r"^ +20 +\d\.\d{3} ", r"epsilon = [\d.]+ at delta = 1e-05$"],
    ),
    "private_lstm.py": (
        ["--steps", "10"],
        [r"^\['w_rec'\] +ghost ", r"^ +10 +\d\.\d{4} ", r"epsilon = [\d.]+ at delta = 1e-05$"],
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


# ---- the demo: statistics over seeds --------------------------------------------------------
# (The tests that read `demo_runs` are slow: the demo trains 3 seeds for 40 steps twice, compiled
# as users compile.)

DEMO_STEPS = 40  # every unclipped seed overflows within this many steps (README: 14 to 30)
DEMO_SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def demo():
    return load_example("rnn_exploding_gradients.py")


@pytest.fixture(scope="module")
def demo_runs(demo):
    """The demo's unclipped and global_clip runs, 3 seeds at once, 40 steps (two compiles)."""
    return {
        mode: demo.train(mode, DEMO_STEPS, DEMO_SEEDS, progress=False)
        for mode in ("no clipping", "global_clip")
    }


@pytest.mark.slow
def test_demo_overflows_without_clipping_and_not_with_global_clip(demo, demo_runs):
    unclipped, clipped = demo_runs["no clipping"], demo_runs["global_clip"]
    # Without clipping every seed's loss is NaN or inf between steps 14 and 30 (README), after
    # its gradient norm grew past 1e6; training stops once every seed has overflowed. (The first
    # steps do not depend on the run's length: these are the default run's seeds 0 to 2.)
    overflow = demo.first_nonfinite_step(unclipped["losses"])
    assert ((overflow >= 14) & (overflow <= 30)).all(), overflow
    assert unclipped["losses"].shape[1] < DEMO_STEPS
    assert (demo.largest_finite(unclipped["grad_norms"]) > 1e6).all()
    assert not np.isfinite(unclipped["final_loss"]).any()
    # With global_clip every seed stays finite through every step.
    assert clipped["losses"].shape == (len(DEMO_SEEDS), DEMO_STEPS)
    for key in ("losses", "grad_norms", "recurrent_grad_norms", "final_loss"):
        assert np.isfinite(clipped[key]).all(), key
    assert (demo.first_nonfinite_step(clipped["losses"]) == -1).all()
    # The seeds are different runs: their losses differ from the first step on.
    assert len(set(clipped["losses"][:, 0].tolist())) == len(DEMO_SEEDS)


@pytest.mark.slow
def test_demo_reads_global_clip_state(demo_runs):
    clipped = demo_runs["global_clip"]
    # clip_count comes from the vmapped state: one counter per seed, equal to the steps whose
    # norm (also read from the state) was over the threshold.
    count = clipped["clip_count"]
    assert count.shape == (len(DEMO_SEEDS),)
    assert np.array_equal(count, (clipped["grad_norms"] > 1.0).sum(axis=1))
    assert np.array_equal(count, clipped["clipped"].sum(axis=1))
    assert ((count > 0) & (count < DEMO_STEPS)).all()
    assert demo_runs["no clipping"]["clip_count"] is None


@pytest.mark.slow
def test_demo_recurrent_gradient_grows_without_clipping(demo, demo_runs):
    # README: each seed's recurrent-weight gradient norm grew at least 177-fold in three steps.
    norms = demo_runs["no clipping"]["recurrent_grad_norms"][:, : demo.GROWTH_STEPS]
    assert np.isfinite(norms).all() and (norms > 0).all()
    assert (norms[:, 3] >= 177 * norms[:, 0]).all(), norms[:, 3] / norms[:, 0]
    line = demo.growth_line(demo_runs["no clipping"])
    assert line.count("[") == demo.GROWTH_STEPS


def synthetic_result(mode, final_loss, losses, grad_norms, clipped=None, clip_count=None):
    losses = np.asarray(losses, dtype=float)
    return {
        "mode": mode,
        "steps": losses.shape[1],
        "seeds": np.arange(len(losses)),
        "final_loss": np.asarray(final_loss, dtype=float),
        "losses": losses,
        "grad_norms": np.asarray(grad_norms, dtype=float),
        "clipped": np.zeros(losses.shape, bool) if clipped is None else np.asarray(clipped),
        "recurrent_grad_norms": np.ones(losses.shape),
        "clip_count": clip_count,
    }


def test_demo_statistics_on_synthetic_runs(demo):
    inf, nan = math.inf, math.nan
    blown = synthetic_result(
        "no clipping",
        final_loss=[nan, nan, 0.2, inf],
        losses=[[1, 5, inf, nan], [1, nan, nan, nan], [1, 2, 3, 4], [1, 9, 1e30, inf]],
        grad_norms=[[1, 3e8, nan, nan], [2, nan, nan, nan], [1, 1, 1, 1], [5, 7, inf, nan]],
    )
    summary = demo.summarize(blown)
    assert summary == {
        "mode": "no clipping",
        "seeds": 4,
        "solved": 0,
        "final_loss_median": inf,  # NaN counts as inf
        "final_loss_min": 0.2,
        "final_loss_max": inf,
        "max_grad_norm_median": 4.5,  # each seed's largest finite norm: 3e8, 2, 1, 7
        "max_grad_norm_max": 3e8,
        "clipped_steps_median": None,
        "steps_run": 4,
        "nonfinite_seeds": 3,
        "nonfinite_step_median": 2.0,  # steps 2, 1, 3
    }
    assert demo.table_cells(summary) == [
        "no clipping", "0/4", "inf", "[0.2, inf]", "4.5", "3e+08", "-", "3/4", "2"
    ]  # fmt: skip

    counted = synthetic_result(
        "value_clip",
        final_loss=[0.001, 0.16, 0.0005],
        losses=np.ones((3, 5)),
        grad_norms=np.full((3, 5), 2.0),
        clipped=[[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]],
    )
    summary = demo.summarize(counted)
    assert (summary["solved"], summary["seeds"]) == (2, 3)  # below SOLVED_BELOW = 0.01
    assert summary["final_loss_median"] == 0.001
    assert (summary["final_loss_min"], summary["final_loss_max"]) == (0.0005, 0.16)
    assert summary["clipped_steps_median"] == 2.0  # 2, 5, 1 steps clipped
    assert (summary["nonfinite_seeds"], summary["nonfinite_step_median"]) == (0, None)
    assert demo.table_cells(summary)[6] == "2/5"
    # global_clip's steps clipped are its state's clip_count, not the recorded flags.
    stated = dict(counted, mode="global_clip", clip_count=np.array([3, 4, 9]))
    assert demo.summarize(stated)["clipped_steps_median"] == 4.0


@pytest.mark.slow
def test_demo_table_prints_the_statistics(demo, demo_runs):
    results = list(demo_runs.values())
    lines = demo.format_table(results).splitlines()
    assert re.split(r"\s{2,}", lines[0].strip()) == [c for c in demo.TABLE_HEADER[0] if c]
    assert re.split(r"\s{2,}", lines[1]) == list(demo.TABLE_HEADER[1])
    assert set(lines[2]) == {"-"}
    for line, result in zip(lines[3:], results, strict=True):
        assert re.split(r"\s{2,}", line) == demo.table_cells(demo.summarize(result))
    unclipped, clipped = (demo.summarize(r) for r in results)
    assert (unclipped["nonfinite_seeds"], unclipped["solved"]) == (len(DEMO_SEEDS), 0)
    assert (clipped["nonfinite_seeds"], clipped["steps_run"]) == (0, DEMO_STEPS)


def test_demo_names_the_machine(demo):
    description = demo.machine_description()
    assert demo.cpu_model().strip()
    assert demo.cpu_model() in description
    assert f"jax {jax.__version__}" in description


def test_demo_notes_runs_too_short_to_leave_the_plateau(demo):
    args = demo.parse_args([])
    assert (args.steps, args.seeds) == (demo.DEFAULT_STEPS, demo.DEFAULT_SEEDS)
    assert demo.short_run_note(demo.DEFAULT_STEPS) is None
    note = demo.short_run_note(demo.DEFAULT_STEPS // 3)
    assert "plateau" in note and f"default {demo.DEFAULT_STEPS} steps" in note
    with pytest.raises(SystemExit):
        demo.parse_args(["--seeds", "0"])


def band_of(ax, label):
    """The (x, y) vertices of the band labelled `label` in `ax`."""
    (band,) = [c for c in ax.collections if c.get_label() == label]
    vertices = np.concatenate([path.vertices for path in band.get_paths()])
    return band, vertices


@pytest.mark.slow
def test_demo_plot(demo, demo_runs, tmp_path):
    from matplotlib import image  # the test extra installs matplotlib: never skipped
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = tmp_path / "curves.png"
    fig = demo.plot(list(demo_runs.values()), path)
    ax_first, ax_loss, ax_norm = fig.axes
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        bottom, top = ax.get_ylim()
        assert 0 < bottom < top
    window = max(1, DEMO_STEPS // demo.PLOT_POINTS)
    clipped = demo_runs["global_clip"]
    for ax, key in ((ax_loss, "losses"), (ax_norm, "grad_norms")):
        # Each clipped mode: its median over the seeds as a line, its min-max range as a band.
        centres, means = demo.window_means(clipped[key], window)
        median, lowest, highest = demo.median_and_range(means, axis=0)
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert np.allclose(lines["global_clip(1)"].get_xdata(), centres)
        assert np.allclose(lines["global_clip(1)"].get_ydata(), median)
        band, vertices = band_of(ax, "global_clip(1): min-max over seeds")
        assert np.isclose(vertices[:, 1].min(), lowest.min())
        assert np.isclose(vertices[:, 1].max(), highest.max())
        assert (lowest <= median).all() and (median <= highest).all()
        assert lowest.min() > 0 and highest.max() > 2 * lowest.min()  # a band, not a line
        bottom, top = ax.get_ylim()
        assert bottom <= lowest.min() and highest.max() <= top  # the whole band in view
        assert "no clipping" not in lines  # it overflowed: it has the first panel
    # The mean predictor's line: in view, drawn over every band and median line.
    for ax in (ax_first, ax_loss):
        (mean_line,) = [line for line in ax.get_lines() if line.get_label() == "predict the mean"]
        assert np.allclose(mean_line.get_ydata(), 1 / 6)
        bottom, top = ax.get_ylim()
        assert bottom < 1 / 6 < top
        others = [a for a in (*ax.get_lines(), *ax.collections) if a is not mean_line]
        assert all(mean_line.get_zorder() > a.get_zorder() for a in others)
    # The first panel: the unclipped seeds' gradient norm up to past the last overflow.
    unclipped = demo_runs["no clipping"]
    overflow = demo.first_nonfinite_step(unclipped["losses"])
    (norm_line,) = [
        line for line in ax_first.get_lines() if line.get_label() == "no clipping: gradient norm"
    ]
    shown = len(norm_line.get_xdata())
    assert shown > overflow.max()
    expected = demo.median_and_range(unclipped["grad_norms"][:, :shown], axis=0)[0]
    assert np.allclose(norm_line.get_ydata(), np.where(np.isfinite(expected), expected, np.nan),
                       equal_nan=True)  # fmt: skip
    band_of(ax_first, "no clipping: gradient norm: min-max over seeds")
    # One legend, outside every panel, at a readable size, naming every curve.
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    for entry in (
        "no clipping: gradient norm",
        "no clipping: training loss",
        "global_clip(1)",
        "predict the mean",
        "min-max over the seeds",
    ):
        assert entry in texts
    assert all(t.get_fontsize() >= 10 for t in legend.get_texts())
    renderer = FigureCanvasAgg(fig).get_renderer()
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    # The saved file is a real image of the figure's size, not a blank one.
    pixels = image.imread(path)
    width, height = demo.FIGSIZE
    assert pixels.shape[:2] == (round(height * demo.DPI), round(width * demo.DPI))
    assert pixels[..., :3].std() > 0.05


@pytest.mark.slow
def test_demo_every_clip_stays_finite(demo):
    """value_clip and norm_clip too (the fast tier runs global_clip only), over more steps."""
    for mode in ("value_clip", "norm_clip"):
        result = demo.train(mode, 100, DEMO_SEEDS, progress=False)
        assert np.isfinite(result["losses"]).all() and np.isfinite(result["final_loss"]).all()
        assert result["losses"].shape == (len(DEMO_SEEDS), 100)
        summary = demo.summarize(result)
        assert summary["nonfinite_seeds"] == 0
        assert 0 < summary["clipped_steps_median"] <= 100
