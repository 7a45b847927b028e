"""README.md's Python blocks run, and print exactly what the README says they print.

A ```python block that prints must be followed by a ```text block holding its output; the block
is run as a reader would run it (a fresh namespace, JAX's default dtype promotion), its standard
output captured and compared line by line.
"""

import contextlib
import io
import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)


def readme_blocks():
    """``(python code, the text block after it or None)`` for every Python block."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer((ROOT / "README.md").read_text())]
    out = []
    for i, (lang, body) in enumerate(blocks):
        if lang == "python":
            after = blocks[i + 1] if i + 1 < len(blocks) else (None, None)
            out.append((body, after[1] if after[0] == "text" else None))
    return out


BLOCKS = readme_blocks()


def test_readme_has_python_examples_with_their_output():
    assert len(BLOCKS) >= 5
    assert sum(expected is not None for _, expected in BLOCKS) >= 5


def lines(text):
    return [line.rstrip() for line in text.strip().splitlines()]


@pytest.mark.every_case  # every README block is checked in the fast tier
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_prints_what_the_readme_says(index):
    code, expected = BLOCKS[index]
    stdout = io.StringIO()
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(stdout):
        exec(compile(code, f"README.md python block {index}", "exec"), {})
    printed = stdout.getvalue()
    if expected is None:
        assert not printed, f"block {index} prints; follow it with a ```text block:\n{printed}"
    else:
        assert lines(printed) == lines(expected)


def test_ci_runs_exactly_the_readme_commands():
    """`.ci/run` runs the README's commands, as written there, then `.ci/wheel` (the fast tier
    against the installed wheel), and nothing else."""
    readme = (ROOT / "README.md").read_text()
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == [
        'python -m pip install -e ".[test]" && python -m pytest -q',
        'python -m pip install -e ".[test,docs]" && python -m pytest -q -m slow',
        "python -m mypy src",
        "bash .ci/wheel",
    ]
    commands = [
        line for _, body in FENCE.findall(readme) for line in body.splitlines() if line.strip()
    ]
    demo = 'python -m pip install -e ".[examples]" && python examples/rnn_exploding_gradients.py'
    for line in [demo, *ci[:-1]]:
        assert line in commands, f"README does not give the command {line!r}"
    assert ".ci/wheel" in readme, "README does not say that CI tests the installed wheel"
