"""examples/loss_scaling.py, in-process on a short run: float16 with loss scaling trains as
float32 does, without it the gradients flush to zero and training stalls (statistics over
seeds); and its plot."""

import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, SEEDS = 300, 3
pytestmark = pytest.mark.slow  # three training runs (~40 s on a shared 2-core machine)


def load_example():
    spec = importlib.util.spec_from_file_location("loss_scaling", ROOT / "examples/loss_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs():
    example = load_example()
    return example, {run: example.train(run, SEEDS, STEPS) for run in example.RUNS}


def test_loss_scaling_matches_float32_and_float16_alone_stalls(runs):
    _, results = runs
    f32 = results["float32"]["losses"][:, -1]
    scaled = results["float16, loss scaling"]["losses"][:, -1]
    alone = results["float16, no loss scaling"]["losses"][:, -1]
    assert f32.shape == (SEEDS,)
    # Seed by seed, float16 with loss scaling ends within 5% of float32 (same data, same init).
    np.testing.assert_allclose(scaled, f32, rtol=0.05)
    assert alone.min() > 2 * f32.max()  # every seed worse than every float32 seed
    assert results["float16, no loss scaling"]["zeros"].mean() > 0.5  # flushed to zero
    assert results["float16, loss scaling"]["zeros"].max() < 0.01
    assert results["float32"]["zeros"].max() < 0.01


def test_the_scale_grows_and_backs_off_by_the_rule(runs):
    example, results = runs
    scales = results["float16, loss scaling"]["scales"]
    assert scales.shape == (SEEDS, STEPS)
    changes = np.diff(np.log2(scales), axis=1)
    assert set(np.unique(changes)) <= {-1.0, 0.0, 1.0}  # x2 or x0.5, nothing else
    grows = np.flatnonzero(changes[0] > 0) + 1  # (0-based step index of each growth)
    assert grows[0] == example.GROWTH_INTERVAL - 1  # after the first 50 finite steps
    assert scales[:, -1].min() > 2.0**16
    skipped = results["float16, loss scaling"]["skipped"]
    np.testing.assert_array_equal(skipped, (changes < 0).sum(axis=1))  # each overflow skipped
    assert results["float32"]["skipped"].sum() == 0


def test_table_and_plot(runs, tmp_path):
    pytest.importorskip("matplotlib")
    example, results = runs
    table = example.format_table(results)
    assert table.splitlines()[0].startswith("run")
    for run in example.RUNS:
        assert any(line.startswith(run) for line in table.splitlines())
    path = tmp_path / "scaling.png"
    example.plot(results, path, STEPS)
    assert path.stat().st_size > 10_000
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 1.5 * height  # two panels side by side
