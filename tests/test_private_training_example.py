"""examples/private_training.py: DP-SGD with ghost clipping prints what its guide shows.

The guide (docs/guides/private-training.md) quotes one run's output; this runs the example
again (in-process, the default 300 steps) and checks that output line by line: the ghost
report and the step column exactly, the difference from the materialising reference under
float32 rounding, the accuracies within a few test examples (another CPU may round otherwise),
epsilon to its printed digits, and the time line by its shape."""

import contextlib
import importlib.util
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "private-training.md"


def guide_output() -> list[str]:
    text = GUIDE.read_text(encoding="utf-8")
    block = re.search(r"```text\n(Which parameters go ghost.*?)```", text, re.S)
    assert block, "the guide quotes no run of examples/private_training.py"
    return block.group(1).rstrip("\n").splitlines()


def run_example() -> list[str]:
    spec = importlib.util.spec_from_file_location(
        "private_training", ROOT / "examples" / "private_training.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main([])
    return out.getvalue().rstrip("\n").splitlines()


def numbers(line: str) -> list[float]:
    return [float(x.rstrip("%")) for x in re.findall(r"-?\d+\.?\d*(?:e[-+]?\d+)?%?", line)]


@pytest.mark.slow
def test_the_example_prints_what_the_guide_shows():
    want, got = guide_output(), run_example()
    assert len(got) == len(want), "\n".join(got)
    for w, g in zip(want, got):
        if w.startswith("clipped sum vs method='vmap'"):
            assert g.startswith("clipped sum vs method='vmap'") and numbers(g)[0] < 1e-5
        elif re.match(r"^ +\d+ ", w):  # a row of the accuracy table: step, acc, clipped, acc
            (ws, wa, wc, wb), (gs, ga, gc, gb) = numbers(w), numbers(g)
            assert gs == ws and abs(ga - wa) <= 0.01 and abs(gb - wb) <= 0.01, g
            assert abs(gc - wc) <= 3, g  # percent of clipped examples
        elif w.startswith("time per step"):
            assert re.match(r"^time per step: DP-SGD [\d.]+ ms, non-private [\d.]+ ms \(", g), g
        elif re.match(r"^\(\d+ s\)$", w):
            assert re.match(r"^\(\d+ s\)$", g), g
        else:  # the report, the headings, epsilon: exactly
            assert g == w
    final = numbers(got[-5])  # the last row of the table
    assert final[1] >= 0.9  # DP-SGD learned the rule (chance is 0.6)
