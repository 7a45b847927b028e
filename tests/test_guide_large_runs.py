"""docs/guides/large_runs.md's Python blocks run, and print exactly the ```text block that
follows each (a fresh namespace each, JAX's default dtype promotion), as README.md's do."""

import contextlib
import io
import pathlib
import re

import jax
import pytest

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "large_runs.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)


def guide_blocks():
    """``(python code, the text block after it or None)`` for every Python block."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(GUIDE.read_text())]
    out = []
    for i, (lang, body) in enumerate(blocks):
        if lang == "python":
            after = blocks[i + 1] if i + 1 < len(blocks) else (None, None)
            out.append((body, after[1] if after[0] == "text" else None))
    return out


BLOCKS = guide_blocks()


def lines(text):
    return [line.rstrip() for line in text.strip().splitlines()]


def test_guide_has_its_sections_and_examples():
    text = GUIDE.read_text()
    assert text.startswith("# Training a large model\n")
    assert "\n## Loss scaling\n" in text and "\n## Skipping spikes\n" in text
    assert len(BLOCKS) >= 3 and all(expected for _, expected in BLOCKS)


@pytest.mark.every_case  # every block is checked in the fast tier
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_guide_block_prints_what_the_guide_says(index):
    code, expected = BLOCKS[index]
    stdout = io.StringIO()
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(stdout):
        exec(compile(code, f"{GUIDE.name} python block {index}", "exec"), {})
    assert lines(stdout.getvalue()) == lines(expected)
