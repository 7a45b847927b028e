"""Sphinx configuration of optclip's documentation site.

Build it (from the repository root, with ``python -m pip install -e ".[docs]"``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Nothing here is a hand-kept list, so the site cannot drift from the code:

* the API page (``api.rst``, directive ``optclip-api``) documents every name of
  ``optclip.__all__``, grouped by what it is; a name no rule recognises goes to "Other";
* the home page (``index.md``) is README.md, included where the page has a line
  ``<!-- include ../README.md -->``; in every Markdown page (the guides, the design pages of
  ``docs/design/``), and in what a page includes, links to files of the repository (written as
  relative paths, so that they work on GitHub) are made to work in the site (see `_site_links`);
* ``docs/examples/`` is written here, one page per ``examples/*.py`` (its module docstring,
  then its full source), and is not kept in git.

The guides are Markdown files in ``docs/guides/``, written for GitHub and the site alike. To add
one: write ``docs/guides/NAME.md`` (a ``# `` title; links relative to the page), add
``guides/NAME`` to the guides' toctree in ``index.md`` (a page in no toctree is a warning, so
an error here), and a paragraph linking it to the README's "Guides" section.
``tests/test_doc_blocks.py`` runs its Python blocks and compares what they print with the
```text block after each; ``tests/test_docs.py`` checks that the page is built and linked.

The design pages (how optclip is built, and why) are Markdown files in ``docs/design/``, listed
in the toctree of ``design/index.md``; ``tests/test_docs.py`` checks that each is a page with
its sections.

Math is rendered to MathML when the site is built (``latex2mathml``): the pages need no
JavaScript and no CDN, and read the same offline.
"""

from __future__ import annotations

import ast
import html
import inspect
import os
import re
import tokenize
import tomllib
from io import StringIO
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

import optclip

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
EXAMPLES = ROOT / "examples"
GENERATED_EXAMPLES = DOCS / "examples"
_PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SOURCE_URL = _PYPROJECT["project"]["urls"]["Source"].rstrip("/")
logger = logging.getLogger(__name__)

# -- Project -------------------------------------------------------------------------------

project = "optclip"
author = "The optclip developers"
copyright = "The optclip developers, Apache-2.0"
release = version = optclip.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
# `max_norm` in a docstring: code font, and a link when it names a documented object.
default_role = "py:obj"

# -- Autodoc and napoleon (the docstrings are Google style) -----------------------------------

autodoc_member_order = "bysource"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# -- Markdown --------------------------------------------------------------------------------

myst_heading_anchors = 3

# -- HTML ------------------------------------------------------------------------------------

html_theme = "furo"
html_title = f"optclip {release}"
html_static_path = ["_static"]
html_css_files = ["optclip.css"]
html_math_renderer = "mathml"
html_show_sourcelink = False
html_copy_source = False


# == The API page ============================================================================

# (title, introduction) of each group, in page order; `_group_of` assigns the names.
API_GROUPS = {
    "Functions": (
        "Pure functions on pytrees: gradients in, clipped gradients (and norms) out, as "
        "TensorFlow's ``tf.clip_by_*`` and ``tf.global_norm``. They work under ``jit``, "
        "``vmap``, ``grad`` and ``shard_map``."
    ),
    "Transformations": (
        "Factories of ``optax.GradientTransformation``: put one before the optimizer in an "
        "``optax.chain`` (Keras' ``clipnorm``, ``clipvalue`` and ``global_clipnorm``), or wrap "
        "the optimizer with :func:`clipped`."
    ),
    "Adaptive transformations": (
        "Transformations whose threshold follows the training: a percentile or a z-score of "
        "the recent gradient norms, or the norms of the parameters."
    ),
    "Logging": "Reading the norms and counters that the clips keep in the optimizer state.",
    "State classes": (
        "The optimizer states of the transformations and their parts: pytrees of arrays, "
        "whose fields can be read by name with ``optax.tree.get(opt_state, name)``."
    ),
    "Exceptions": "",
    "Other": "",
}


def _is_pytree_node(obj: type) -> bool:
    """Whether instances of class `obj` are pytree nodes: a NamedTuple or a pytree class."""
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):
        return True
    return hasattr(obj, "tree_flatten") or hasattr(obj, "tree_flatten_with_keys")


def _group_of(obj: object) -> str:
    """The API group of a public object; "Other" when no rule applies."""
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return "Exceptions"
        if obj.__name__.endswith("State") or _is_pytree_node(obj):
            return "State classes"
        return "Other"
    if inspect.isfunction(obj):
        module = getattr(obj, "__module__", "") or ""
        returns = str(inspect.signature(obj).return_annotation)
        if "GradientTransformation" in returns:
            return "Adaptive transformations" if "adaptive" in module else "Transformations"
        if "metric" in module:
            return "Logging"
        return "Functions"
    return "Other"


def api_groups() -> dict[str, list[str]]:
    """Every name of ``optclip.__all__``, in its order, by group (empty groups dropped)."""
    groups: dict[str, list[str]] = {title: [] for title in API_GROUPS}
    for name in optclip.__all__:
        groups[_group_of(getattr(optclip, name))].append(name)
    return {title: names for title, names in groups.items() if names}


def _autodoc_lines(name: str) -> list[str]:
    obj = getattr(optclip, name)
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return [f".. autoexception:: {name}", ""]
    if inspect.isclass(obj) and issubclass(obj, tuple):  # a NamedTuple: every field
        return [f".. autoclass:: {name}", "   :members:", "   :undoc-members:", ""]
    if inspect.isclass(obj):
        return [f".. autoclass:: {name}", "   :members:", ""]
    if inspect.isfunction(obj):
        return [f".. autofunction:: {name}", ""]
    return [f".. autodata:: {name}", ""]


class OptclipAPI(SphinxDirective):
    """``.. optclip-api::``: every name of ``optclip.__all__``, one section per group."""

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(inspect.getsourcefile(optclip))  # __all__ may change
        lines: list[str] = []
        for title, names in api_groups().items():
            lines += [title, "-" * len(title), ""]
            if API_GROUPS[title]:
                lines += [API_GROUPS[title], ""]
            lines += [".. autosummary::", "   :nosignatures:", ""]
            lines += [f"   {name}" for name in names] + [""]
            for name in names:
                lines += _autodoc_lines(name)
        container = nodes.section()
        container.document = self.state.document
        source = self.get_source_info()[0]
        nested_parse_with_titles(
            self.state, StringList(lines, source=f"{source} (optclip-api)"), container
        )
        return container.children


def _field_comments(cls: type) -> dict[str, str]:
    """The trailing ``# comment`` of each field of a NamedTuple class, by field name."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    source = inspect.cleandoc("\n" + source) if source.startswith(" ") else source
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    fields = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields[node.target.id] = comments.get(node.end_lineno, "")
    return fields


def _document_namedtuple_fields(app, what, name, obj, options, lines):
    """Replaces a NamedTuple field's "Alias for field number N" by its comment in the source."""
    if not (len(lines) == 1 and lines[0].startswith("Alias for field number")):
        return
    cls_name, _, field = name.rpartition(".")
    cls = getattr(optclip, cls_name.rpartition(".")[2], None)
    comment = _field_comments(cls).get(field, "") if inspect.isclass(cls) else ""
    # A comment is plain text, but for its `name` and ``code`` spans: escape the rest.
    parts = re.split(r"(``.+?``|`[^`]+`)", comment)
    comment = "".join(
        part if part.startswith("`") else re.sub(r"([\\*|_<>\[\]])", r"\\\1", part)
        for part in parts
    )
    if re.match(r"[a-z]+\b(?![(_.\w])", comment):  # a word, not code: a sentence
        comment = comment[0].upper() + comment[1:]
    if comment and not comment.endswith((".", "!", "?")):
        comment += "."
    lines[:] = [comment] if comment else []


# == Markdown: README.md included, links made to work in the site ================================

_FENCE = re.compile(r"^\s*(```+|~~~+)")
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
_EXAMPLE_CODE = re.compile(r"(?<!\[)`examples/(\w+)\.py`")
INCLUDE = re.compile(r"^<!-- include (\S+) -->$", re.MULTILINE)


def _example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def included_files() -> dict[Path, Path]:
    """Each file of the repository that a page of the site includes, and that page's source."""
    pages = {}
    for page in DOCS.rglob("*.md"):
        if GENERATED_EXAMPLES in page.parents or "_build" in page.parts:
            continue
        for match in INCLUDE.finditer(page.read_text(encoding="utf-8")):
            pages[(page.parent / match.group(1)).resolve()] = page
    return pages


def _site_target(target: str, source_dir: Path, page_dir: Path, image: bool) -> str:
    """A link's target, written in a file of `source_dir`, as it must read on a page of
    `page_dir`: a page of the site where there is one, else the file on the source host."""
    path_part, hash_mark, fragment = target.partition("#")
    path = (source_dir / path_part).resolve()
    if not path.exists() or ROOT not in path.parents:
        return target  # left for Sphinx to report
    if image:
        return os.path.relpath(path, page_dir)
    if path.parent == EXAMPLES and path.suffix == ".py" and path.stem in _example_names():
        path = GENERATED_EXAMPLES / f"{path.stem}.rst"
    path = included_files().get(path, path)
    if DOCS in path.parents and path.suffix in source_suffix:
        return os.path.relpath(path, page_dir) + hash_mark + fragment
    kind = "tree" if path.is_dir() else "blob"
    return f"{SOURCE_URL}/{kind}/main/{path.relative_to(ROOT).as_posix()}" + hash_mark + fragment


def _site_links(markdown: str, source_dir: Path, page_dir: Path) -> str:
    """Markdown written in `source_dir` (README.md, a guide, a design page), with its links
    made to work from a page of the site in `page_dir`.

    Relative links are written for GitHub, as paths from the file to the file they point to.
    In the site, a link to README.md goes to the page that includes it (the home page), one to
    an example (and a bare `` `examples/NAME.py` ``) to the example's page, one to a page of the
    site (a guide, ``docs/design/NAME.md``) stays a link to that page, and one to another file
    of the repository goes to it on the source host. Fenced code blocks are left as they are.
    """
    examples = set(_example_names())
    out, fence = [], None

    def link(match: re.Match) -> str:
        bang, text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):  # URL, anchor or absolute
            return match.group(0)
        return f"{bang}[{text}]({_site_target(target, source_dir, page_dir, bool(bang))})"

    def example_code(match: re.Match) -> str:
        name = match.group(1)
        if name not in examples:
            return match.group(0)
        target = os.path.relpath(GENERATED_EXAMPLES / f"{name}.rst", page_dir)
        return f"[`examples/{name}.py`]({target})"

    def rewrite(prose: list[str]) -> list[str]:  # a link's text may span lines
        text = _EXAMPLE_CODE.sub(example_code, _LINK.sub(link, "\n".join(prose)))
        return text.split("\n") if prose else []

    prose: list[str] = []
    for line in markdown.splitlines():
        opening = _FENCE.match(line)
        if fence is None and opening:
            out += rewrite(prose) + [line]
            prose, fence = [], opening.group(1)
        elif fence is not None:
            out.append(line)
            if line.strip().startswith(fence):
                fence = None
        else:
            prose.append(line)
    return "\n".join(out + rewrite(prose)) + "\n"


def _markdown_source(app, docname, source):
    """A Markdown page as the site shows it: its links made to work in the site, and every
    ``<!-- include PATH -->`` line replaced by that file (PATH relative to the page), whose
    links are made to work from the page too."""
    page = Path(app.env.doc2path(docname))
    if page.suffix != ".md":
        return
    page_dir = page.parent

    def include(match: re.Match) -> str:
        path = (page_dir / match.group(1)).resolve()
        app.env.note_dependency(str(path))
        return _site_links(path.read_text(encoding="utf-8"), path.parent, page_dir)

    source[0] = INCLUDE.sub(include, _site_links(source[0], page_dir, page_dir))


# == examples/: one generated page each =====================================================

_GENERATED = ".. Generated by docs/conf.py from {path}; edits here are overwritten."


def _write_if_changed(path: Path, text: str) -> None:
    """Writes `text` unless `path` already holds it (so Sphinx sees no change), atomically."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _title(text: str, underline: str = "=") -> list[str]:
    return [text, underline * len(text), ""]


def example_pages() -> dict[str, str]:
    """reST of ``examples/index`` and of one page per example, by file name."""
    pages = {}
    entries = []
    for name in _example_names():
        path = EXAMPLES / f"{name}.py"
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        summary, _, body = doc.partition("\n")
        lines = [_GENERATED.format(path=f"examples/{name}.py"), ""]
        lines += _title(f"{name}.py")
        lines += [summary, "", body.strip(), ""] if summary else []
        lines += _title("Source", "-")
        lines += [
            f"``examples/{name}.py``, from the repository root: ``python examples/{name}.py``.",
            "",
            f".. literalinclude:: ../../examples/{name}.py",
            "   :language: python",
            "",
        ]
        pages[f"{name}.rst"] = "\n".join(lines)
        entries.append((name, summary))
    index = [_GENERATED.format(path="examples/*.py"), ""]
    index += _title("Examples")
    index += [
        "Each example is a script that runs on its own, from the repository root: "
        "``python examples/NAME.py``, and ``python examples/NAME.py --help`` lists its "
        "options. Each page shows the script's docstring, then its whole source.",
        "",
    ]
    for name, summary in entries:
        index += [f":doc:`{name}.py <{name}>`", f"   {summary}", ""]
    index += [".. toctree::", "   :hidden:", ""]
    index += [f"   {name}" for name, _ in entries] + [""]
    pages["index.rst"] = "\n".join(index)
    return pages


def write_example_pages() -> None:
    """Writes ``docs/examples/``, and removes the pages of examples that are gone."""
    GENERATED_EXAMPLES.mkdir(exist_ok=True)
    pages = example_pages()
    for file_name, text in pages.items():
        _write_if_changed(GENERATED_EXAMPLES / file_name, text)
    for stale in GENERATED_EXAMPLES.glob("*.rst"):
        if stale.name not in pages:
            stale.unlink(missing_ok=True)


write_example_pages()


# == Math as MathML ==========================================================================


_MATH_FIXES = (
    # \max, \operatorname{rms}: a function name is an identifier, not a spaced-out operator.
    (r"<mo>([A-Za-z]{2,})</mo>", r"<mi>\1</mi>"),
    # Brackets and bars as in TeX: no operator spacing around ( ) [ ] { } | and the norm's ‖.
    (
        r'<mo( fence="false")? stretchy="false">(&#x0002[89];|&#x0005[BD];|&#x0007[BCD];|'
        r"&#x02016;)</mo>",
        r'<mo\1 stretchy="false" lspace="0" rspace="0">\2</mo>',
    ),
    # Arrows (\iff, \implies come out as identifiers): relations, spaced as in TeX.
    (r"<mi>(&#x0(?:21[9A-F]|27F)[0-9A-F];)</mi>", r"<mo>\1</mo>"),
    # Escaped characters in \text{max\_norm}: the characters themselves.
    (r"\\([_%#$&{}])", lambda m: "&amp;" if m.group(1) == "&" else m.group(1)),
)


def _mathml(latex: str, block: bool, node: nodes.Node) -> str:
    """`latex` as MathML; a warning (an error under -W) for what latex2mathml cannot do."""
    from latex2mathml.converter import convert

    try:
        mathml = convert(latex.strip(), display="block" if block else "inline")
    except Exception as error:  # any failure of the converter
        logger.warning("math: latex2mathml cannot convert %r: %s", latex, error, location=node)
        return f'<code class="math">{html.escape(latex)}</code>'
    for pattern, replacement in _MATH_FIXES:
        mathml = re.sub(pattern, replacement, mathml)
    if unknown := re.findall(r"\\[A-Za-z]+|\\.", mathml):
        logger.warning(
            "math: latex2mathml does not know %s in %r", ", ".join(unknown), latex, location=node
        )
    return mathml


def _visit_math(self, node):
    self.body.append(self.starttag(node, "span", "", CLASS="math"))
    self.body.append(_mathml(node.astext(), False, node))
    self.body.append("</span>")
    raise nodes.SkipNode


def _visit_displaymath(self, node):
    self.body.append(self.starttag(node, "div", CLASS="math"))
    for part in node.astext().split("\n\n"):  # blank-line separated: one equation each
        if part.strip():
            self.body.append(_mathml(part, True, node))
    self.body.append("</div>\n")
    raise nodes.SkipNode


def setup(app):
    app.add_directive("optclip-api", OptclipAPI)
    app.connect("autodoc-process-docstring", _document_namedtuple_fields)
    app.connect("source-read", _markdown_source)
    app.add_html_math_renderer(
        "mathml", inline_renderers=(_visit_math, None), block_renderers=(_visit_displaymath, None)
    )
    return {"parallel_read_safe": True, "parallel_write_safe": True}
