"""The Python blocks of README.md and of the guides: found, run, their printed output captured.

``tests/test_doc_blocks.py`` runs the blocks of most pages in its own process. A page whose
blocks need several devices says so in an HTML comment (invisible on GitHub and in the site)::

    <!-- blocks run on 8 CPU devices -->

and its blocks run here, in a subprocess that JAX starts on that many CPU devices::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_workers/doc_blocks.py PAGE

which prints ``RESULT <json>`` last: for each block, by the line of its opening fence, what it
printed, and the traceback if it raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pathlib
import re
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
_OPENING = re.compile(r"^(```+|~~~+)\s*([^\s`{]*)")
_DEVICES = re.compile(r"<!-- blocks run on (\d+) CPU devices -->")


@dataclasses.dataclass(frozen=True)
class Block:
    """A ```python block of a page, and the ```text block after it (its printed output)."""

    page: str  # the page's path, relative to the repository root
    line: int  # the line of the opening fence, counted from 1
    code: str
    expected: str | None  # the body of the next fenced block if it is ```text, else None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _fences(markdown: str) -> list[tuple[str, int, int, str]]:
    """``(language, opening line, closing line, body)`` of every closed fenced block.

    A fence closes at a line of the same character, at least as long, with nothing after it
    (CommonMark's rule), so a block may show a shorter fence inside it.
    """
    blocks, opening = [], None
    for number, line in enumerate(markdown.splitlines(), start=1):
        if opening is None:
            match = _OPENING.match(line)
            if match:
                opening, language, body, start = match.group(1), match.group(2), [], number
        elif len(line.strip()) >= len(opening) and set(line.strip()) == {opening[0]}:
            blocks.append((language, start, number, "\n".join(body) + "\n"))
            opening = None
        else:
            body.append(line)
    return blocks


def fenced_blocks(markdown: str) -> list[tuple[str, int, str]]:
    """``(language, line of the opening fence, body)`` of every fenced block, in order."""
    return [(language, start, body) for language, start, _, body in _fences(markdown)]


def prose(markdown: str) -> str:
    """`markdown` with its fenced blocks (fences included) blanked out."""
    kept = markdown.splitlines()
    for _, start, end, _ in _fences(markdown):
        kept[start - 1 : end] = [""] * (end - start + 1)
    return "\n".join(kept)


def python_blocks(path: pathlib.Path) -> list[Block]:
    """Every ```python block of the page at `path`, with the ```text block that follows it."""
    fenced = fenced_blocks(path.read_text(encoding="utf-8"))
    page = path.resolve().relative_to(ROOT).as_posix()
    blocks = []
    for i, (language, line, body) in enumerate(fenced):
        if language == "python":
            after = fenced[i + 1] if i + 1 < len(fenced) else ("", 0, None)
            blocks.append(Block(page, line, body, after[2] if after[0] == "text" else None))
    return blocks


def devices(path: pathlib.Path) -> int:
    """The number of CPU devices the page's blocks need (1 unless the page says otherwise)."""
    match = _DEVICES.search(path.read_text(encoding="utf-8"))
    return int(match.group(1)) if match else 1


def run(block: Block) -> str:
    """Runs `block` as a reader would (a fresh namespace, JAX's default dtype promotion) and
    returns what it printed."""
    import jax

    stdout = io.StringIO()
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(stdout):
        exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})
    return stdout.getvalue()


def main(page: str) -> None:
    results = {}
    for block in python_blocks(ROOT / page):
        try:
            results[block.line] = {"stdout": run(block), "error": None}
        except Exception:  # noqa: BLE001 - reported with the block's line, the others still run
            results[block.line] = {"stdout": "", "error": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
