"""The documentation site builds with warnings as errors, and shows what it should.

One Sphinx build (a few seconds) into a temporary folder, then its HTML is read: every name of
``optclip.__all__`` (and every field of the state classes) on the API page, a page per
example with its docstring and whole source, README.md as the home page (its quickstart code
included) with links to every guide, the API page, the examples and the design pages, each guide
of ``docs/guides/`` as a page with its code and output, each design page of ``docs/design/`` as
a page with its sections, no raw reST or TeX in the rendered text, and no broken internal link.
Needs the docs extra: ``python -m pip install -e ".[docs]"``.
"""

import ast
import importlib.util
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from _workers import doc_blocks

import optclip

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
DOCS_EXTRA = ("sphinx", "myst_parser", "furo", "latex2mathml")
BUILD_COMMAND = "python -m sphinx -W --keep-going -b html docs docs/_build/html"


class Page(HTMLParser):
    """An HTML page's element ids, headings, links and visible text."""

    def __init__(self, path: Path):
        super().__init__(convert_charrefs=True)
        self.path = path
        self.ids: set[str] = set()
        self.headings: list[str] = []
        self.hrefs: list[str] = []
        self.math_elements = 0
        self._text: list[str] = []
        self._heading: list[str] | None = None
        self._hidden: list[str] = []  # open <script>, <style> or permalink ("¶") elements
        self.feed(path.read_text(encoding="utf-8"))
        self.text = normalize("".join(self._text))

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])
        if tag == "math":
            self.math_elements += 1
        if tag in ("script", "style") or "headerlink" in (attrs.get("class") or "").split():
            self._hidden.append(tag)
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = []

    def handle_endtag(self, tag):
        if self._hidden and self._hidden[-1] == tag:
            self._hidden.pop()
        if re.fullmatch(r"h[1-6]", tag) and self._heading is not None:
            self.headings.append(normalize("".join(self._heading)))
            self._heading = None

    def handle_data(self, data):
        if self._hidden:
            return
        self._text.append(data)
        if self._heading is not None:
            self._heading.append(data)


def normalize(text: str) -> str:
    """Text as typed: straight quotes, single spaces."""
    for curly, straight in (("\u2018", "'"), ("\u2019", "'"), ("\u201c", '"'), ("\u201d", '"')):
        text = text.replace(curly, straight)
    return " ".join(text.split())


def markdown_to_text(line: str) -> str:
    """A line of Markdown or reST as the site shows it: no backticks, asterisks or links."""
    line = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line)
    return normalize(line.replace("`", "").replace("**", ""))


def markdown_headings(path: Path) -> tuple[str, list[str]]:
    """A Markdown file's title and its ``## `` headings, outside code fences."""
    title, sections = None, []
    for line in doc_blocks.prose(path.read_text(encoding="utf-8")).splitlines():
        if line.startswith("# ") and title is None:
            title = markdown_to_text(line[2:])
        elif line.startswith("## "):
            sections.append(markdown_to_text(line[3:]))
    return title, sections


def code_lines(path: Path) -> list[str]:
    """Every non-blank line of the Python blocks of a Markdown file, and of their output."""
    blocks = doc_blocks.python_blocks(path)
    texts = [b.code for b in blocks] + [b.expected for b in blocks if b.expected]
    return [normalize(line) for text in texts for line in text.splitlines() if line.strip()]


GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
DESIGN = sorted((ROOT / "docs" / "design").glob("*.md"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = [name for name in DOCS_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(
            f"the documentation test needs the docs extra ({', '.join(missing)} not installed): "
            'python -m pip install -e ".[docs]"',
            pytrace=False,
        )
    out = tmp_path_factory.mktemp("html")
    doctrees = tmp_path_factory.mktemp("doctrees")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html"]
    command += ["-d", str(doctrees), "docs", str(out)]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False
    )
    assert result.returncode == 0, (
        f"the docs build failed (locally: {BUILD_COMMAND}):\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-6000:]}"
    )
    return out


def test_api_page_documents_every_public_name(site):
    page = Page(site / "api.html")
    missing = [name for name in optclip.__all__ if f"optclip.{name}" not in page.ids]
    assert not missing, f"names of optclip.__all__ not on the API page: {missing}"
    for name in optclip.__all__:
        obj = getattr(optclip, name)
        if isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
            fields = [f for f in obj._fields if f"optclip.{name}.{f}" not in page.ids]
            assert not fields, f"fields of optclip.{name} not on the API page: {fields}"
    assert "Alias for field number" not in page.text  # the fields' comments replace it
    # The groups, and every name in the summary table of its group.
    assert {"Functions", "Transformations", "State classes"} <= set(page.headings)
    for name in optclip.__all__:
        assert f'href="#optclip.{name}"' in page.path.read_text(encoding="utf-8"), name


def test_api_page_renders_markup_and_math(site):
    page = Page(site / "api.html")
    for raw in (":func:`", ":class:`", ":math:`", "``", ".. math::", "\\frac", "\\|", "\\max"):
        assert raw not in page.text, f"raw markup {raw!r} shows on the API page"
    # Every ".. math::" block and :math: role of the docstrings became MathML.
    docstrings = [getattr(optclip, name).__doc__ or "" for name in optclip.__all__]
    expected = sum(d.count(".. math::") + d.count(":math:`") for d in docstrings)
    assert page.math_elements >= expected > 0


def test_every_example_has_a_page(site):
    index = Page(site / "examples" / "index.html")
    for path in EXAMPLES:
        html = site / "examples" / f"{path.stem}.html"
        assert html.exists(), f"no page for {path.name}"
        page = Page(html)
        assert page.headings[0] == path.name
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        summary = markdown_to_text(docstring.partition("\n")[0])
        assert summary in page.text, f"{path.name}: its docstring's first line is missing"
        assert summary in index.text, f"examples/index: {path.name} is not listed"
        # The whole source: its first and last lines of code.
        code = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        assert normalize(code[0]) in page.text and normalize(code[-1]) in page.text


def test_readme_is_the_home_page(site):
    title, sections = markdown_headings(ROOT / "README.md")
    home = Page(site / "index.html")
    assert home.headings[0] == title
    first_paragraph = (ROOT / "README.md").read_text(encoding="utf-8").split("\n\n")[1]
    assert markdown_to_text(first_paragraph) in home.text
    missing = [heading for heading in sections if heading not in home.headings]
    assert not missing, f"README sections not on the home page: {missing}"
    quickstart = doc_blocks.python_blocks(ROOT / "README.md")[0]
    assert "Quickstart" in sections and "optclip.global_clip" in quickstart.code
    for line in quickstart.code.splitlines() + quickstart.expected.splitlines():
        assert normalize(line) in home.text, f"quickstart line not on the home page: {line!r}"


def test_home_page_links_guides_api_examples_and_design(site):
    hrefs = {urlsplit(href).path for href in Page(site / "index.html").hrefs}
    pages = [f"guides/{g.stem}.html" for g in GUIDES]
    pages += ["api.html", "examples/index.html", "design/index.html"]
    missing = [page for page in pages if page not in hrefs]
    assert not missing, f"pages the home page does not link to: {missing}"


@pytest.mark.parametrize("guide", GUIDES, ids=[g.stem for g in GUIDES])
@pytest.mark.every_case  # one build serves all
def test_every_guide_is_a_page_with_its_code_and_output(site, guide):
    title, sections = markdown_headings(guide)
    page = Page(site / "guides" / f"{guide.stem}.html")
    assert page.headings[0] == title
    assert not [heading for heading in sections if heading not in page.headings]
    missing = [line for line in code_lines(guide) if line not in page.text]
    assert not missing, f"{guide.name}: code or output not on its page: {missing[:3]}"


@pytest.mark.parametrize("design", DESIGN, ids=[d.stem for d in DESIGN])
@pytest.mark.every_case  # one build serves all
def test_every_design_page_is_a_page_with_its_sections(site, design):
    title, sections = markdown_headings(design)
    html = site / "design" / f"{design.stem}.html"
    assert html.exists(), f"docs/design/{design.name} is not a page of the site"
    page = Page(html)
    assert page.headings[0] == title
    missing = [heading for heading in sections if heading not in page.headings]
    assert not missing, f"{design.name}: sections not on its page: {missing}"


def test_internal_links_resolve(site):
    pages = {path: Page(path) for path in site.rglob("*.html")}
    broken = []
    for path, page in pages.items():
        for href in page.hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if not target.exists():
                broken.append(f"{path.relative_to(site)}: {href}")
            elif parts.fragment and target in pages and parts.fragment not in pages[target].ids:
                broken.append(f"{path.relative_to(site)}: {href} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)
