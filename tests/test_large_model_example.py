"""examples/large_model.py: the guards of a large run together in a Flax NNX model with scanned
blocks. Its printed output is checked for structure and for the planted events: the early
overflows skipped with the scale halved, the corrupted batch skipped as a spike, the per-layer
norms of the scanned blocks, and a loss that went down. No digits that could change across CPUs
are compared."""

import contextlib
import importlib.util
import io
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS, SPIKE_AT = 60, 45


def load_example():
    spec = importlib.util.spec_from_file_location("large_model", ROOT / "examples/large_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "40", "--spike-at", "40"], r"--spike-at must be in \[.*\) = \[30, 40\)"),
        (["--spike-at", "5"], r"--spike-at must be in \[.*\) = \[30, 400\)"),
        (["--window", "3"], r"--window must be >= 4"),
        (["--log-every", "0"], r"--log-every must be >= 1"),
    ],
)
def test_bad_arguments_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        load_example().parse_args(argv)
    assert re.search(match, capsys.readouterr().err)


@pytest.fixture(scope="module")
def run():
    """One short run of the example's `main`, in-process: its output and its returns."""
    example = load_example()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses, history, why = example.main(["--steps", str(STEPS), "--spike-at", str(SPIKE_AT)])
    return out.getvalue(), losses, history, why


NUMBER = r"[-+0-9.e]+|inf|nan"
LOG_LINE = re.compile(
    rf"^step +(\d+)  loss +({NUMBER})  scale +(\d+)  norm +({NUMBER})  skipped +(\d+)  "
    rf"spikes (\d+)  largest (\S+) \(({NUMBER})\)(?:  skipped \((overflow|spike)\))?$"
)


@pytest.mark.slow  # builds the model and compiles the step: ~10 s alone, ~25 s on a loaded CPU
def test_output_structure(run):
    text, losses, _, _ = run
    lines = text.splitlines()
    assert re.match(r"^JAX \S+ on .+; 60 steps of batch 256; 4 scanned blocks", lines[0])
    log = [LOG_LINE.match(line) for line in lines if line.startswith("step ")]
    assert all(log), [
        line for line in lines if line.startswith("step ") and not LOG_LINE.match(line)
    ]
    steps = [int(m[1]) for m in log]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == STEPS - 1
    assert {0, 50} <= set(steps)  # every --log-every (50) steps
    assert re.search(r"^trained in [0-9.]+ s$", text, re.M)
    for pattern in (
        r"^steps skipped for overflow: \d+ \(steps \[[0-9, ]+\]; the scale after them: [0-9, ]+\)$",
        r"^steps skipped as spikes: \d+ \(steps \[[0-9, ]*\]\)$",
        rf"^loss: first ({NUMBER}), final ({NUMBER}) \(({NUMBER})x\)$",
        r"^per-layer norms of the last step:$",
        r"^AdaGC's clip count per leaf:$",
    ):
        assert re.search(pattern, text, re.M), pattern
    for i in range(4):  # the scanned blocks' per-layer norms, named as if unrolled
        assert re.search(rf"^  blocks/{i} +{NUMBER}$", text, re.M)
    for leaf in ("blocks/linear/kernel", "blocks/norm/scale", "embed/kernel", "head/bias"):
        assert re.search(rf"^  {leaf} +\d+$", text, re.M)  # AdaGC's per-leaf clip counts
    np.testing.assert_allclose(float(log[0][2]), losses[0], rtol=1e-3)  # the printed loss


@pytest.mark.slow
def test_the_planted_events(run):
    text, losses, history, why = run
    # The corrupted batch is skipped as a spike, and no other step is.
    assert re.search(rf"^step +{SPIKE_AT} .* spikes 1 .* skipped \(spike\)$", text, re.M)
    assert re.search(rf"^steps skipped as spikes: 1 \(steps \[{SPIKE_AT}\]\)$", text, re.M)
    assert [s for s, w in enumerate(why) if w == "spike"] == [SPIKE_AT]
    # The first step(s) overflow at 2**16: skipped, the scale halved each time; then no more.
    overflows = [s for s, w in enumerate(why) if w == "overflow"]
    assert overflows and overflows == list(range(len(overflows)))
    scales = [float(h["loss_scale/loss_scale"]) for h in history]
    assert scales[len(overflows) - 1] == 2.0**16 / 2 ** len(overflows)
    assert re.search(r"^step +0 .* scale +32768 .* skipped \(overflow\)$", text, re.M)
    assert re.search(rf"^steps skipped for overflow: {len(overflows)} \(steps \[0", text, re.M)
    # Every skip is one of the two; the counters agree with the lines.
    skips = [s for s, h in enumerate(history) if h["guarded/skipped"]]
    assert skips == sorted(overflows + [SPIKE_AT])
    assert int(history[-1]["guarded/skip_count"]) == len(skips)
    # The spike's gradient norm is far above the steps before it (finite: not an overflow).
    norms = np.array([float(h["guarded/global_norm"]) for h in history])
    assert (
        np.isfinite(norms[SPIKE_AT]) and norms[SPIKE_AT] > 5 * norms[SPIKE_AT - 10 : SPIKE_AT].max()
    )
    # The loss went down, as printed.
    first, final = map(
        float, re.search(rf"^loss: first ({NUMBER}), final ({NUMBER})", text, re.M).groups()
    )
    assert final < 0.2 * first
    assert losses[-1] < 0.2 * losses[0]
