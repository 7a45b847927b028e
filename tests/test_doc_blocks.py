"""The Python blocks of README.md and of every guide run, and print exactly what the page says.

A ```python block that prints must be followed by a ```text block holding its output; each block
is run as a reader would run it (a fresh namespace, JAX's default dtype promotion), its standard
output captured and compared line by line. Blocks are found and run by ``_workers/doc_blocks.py``.

Adding a guide: write ``docs/guides/NAME.md`` (plain Markdown that GitHub renders too; links to
files of the repository are relative to the page), add ``guides/NAME`` to the guides' toctree in
``docs/index.md`` and a paragraph linking it to the README's "Guides". Its blocks are collected
here with no change to this file. A page whose blocks need several devices says so with
``<!-- blocks run on 8 CPU devices -->``; its blocks then run together in one subprocess with
JAX on that many CPU devices (write them so that they print the same on any device count).

The pages show a CPU's output. On another backend the text must match but its decimal numbers
only to a relative 1e-3 (`same_but_digits`): a GPU's float32 division and square root may be an
ulp off the correctly rounded value (XLA emits its approximate forms there), and its float16
products add in another order, so the last printed digits may differ.
"""

import os
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _workers import doc_blocks, launch
from jax._src import compiler  # (private: what the tests' compile setting wraps)
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = doc_blocks.ROOT
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
PAGES = [README, *GUIDES]
BLOCKS = [block for page in PAGES for block in doc_blocks.python_blocks(page)]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def lines(text):
    return [line.rstrip() for line in text.strip().splitlines()]


_DECIMAL = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+")


def same_but_digits(printed: str, expected: str) -> bool:
    """The same lines once every decimal number is set aside (and the spaces NumPy pads an
    array's entries with), and the decimal numbers equal to a relative 1e-3 (NaN to NaN);
    integers, words and signs as they are."""
    skeleton = lambda text: [re.sub(r"\s+", "", _DECIMAL.sub("#", x)) for x in lines(text)]  # noqa: E731
    numbers = lambda text: [float(x) for x in _DECIMAL.findall(text)]  # noqa: E731
    a, b = numbers(printed), numbers(expected)
    return (
        skeleton(printed) == skeleton(expected)
        and len(a) == len(b)
        and np.allclose(a, b, rtol=1e-3, atol=1e-6, equal_nan=True)
    )


@pytest.fixture(scope="module")
def several_devices():
    """The printed output of the blocks of a page that needs several devices, by block line:
    all of the page's blocks run in one subprocess, once per test session."""
    results: dict = {}

    def output(block: doc_blocks.Block) -> str:
        if block.page not in results:
            count = doc_blocks.devices(ROOT / block.page)
            proc = subprocess.run(
                [sys.executable, str(launch.WORKERS / "doc_blocks.py"), block.page],
                env=launch.env_for(count),
                capture_output=True,
                text=True,
                timeout=launch.TIMEOUT_S,
                check=False,
            )
            results[block.page] = launch.result(proc.stdout)
            assert results[block.page] is not None, (
                f"{block.page}: the {count}-device run printed no result:\n{proc.stderr[-3000:]}"
            )
        outcome = results[block.page][str(block.line)]
        if outcome["error"]:
            pytest.fail(f"{block.name} raised:\n{outcome['error']}", pytrace=False)
        return outcome["stdout"]

    return output


def test_pages_have_python_examples_with_their_output():
    assert GUIDES, "no guides in docs/guides/"
    readme = [block for block in BLOCKS if block.page == "README.md"]
    assert len(readme) >= 3 and sum(block.expected is not None for block in readme) >= 2
    assert sum(block.expected is not None for block in BLOCKS) >= 10


# The README's blocks run in the fast tier; the guides' blocks, which compile a model or a
# training loop each as users do, in the slow tier (CI runs both).
@pytest.mark.every_case
@pytest.mark.parametrize(
    "block",
    [b if b.page == "README.md" else pytest.param(b, marks=pytest.mark.slow) for b in BLOCKS],
    ids=[block.name for block in BLOCKS],
)
def test_block_prints_what_the_page_says(block, as_users_compile_module, several_devices):
    if doc_blocks.devices(ROOT / block.page) > 1:
        printed = several_devices(block)
    else:
        printed = doc_blocks.run(block)
    if block.expected is None:
        assert not printed, f"{block.name} prints; follow it with a ```text block:\n{printed}"
    elif jax.default_backend() == "cpu" or not same_but_digits(printed, block.expected):
        assert lines(printed) == lines(block.expected), block.name


def test_readme_links_every_guide():
    linked = set(_LINK.findall(README.read_text(encoding="utf-8")))
    missing = [g.name for g in GUIDES if f"docs/guides/{g.name}" not in linked]
    assert not missing, f"guides without a paragraph and link in README.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
@pytest.mark.every_case
def test_relative_links_point_to_files(page):
    """A link to a file of the repository works on GitHub: the file exists where it points."""
    broken = []
    for target in _LINK.findall(doc_blocks.prose(page.read_text(encoding="utf-8"))):
        path = target.split("#")[0]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or not path:
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files: {broken}"


def test_ci_runs_exactly_the_readme_commands():
    """`.ci/run` runs the README's commands, as written there, then `.ci/installed`: side by
    side, `.ci/wheel` (the fast tier against the installed wheel) and `.ci/lowest` (the fast tier
    at the lowest versions), and
    nothing else: before them it only sets up the persistent compilation cache its stages share
    (a fresh folder, removed at the end), which changes no result."""
    readme = README.read_text()
    ci = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci[:3] == [
        "JAX_COMPILATION_CACHE_DIR=$(mktemp -d)",
        "export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0",
        """trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT""",
    ]
    ci = ci[3:]
    assert ci == [
        'python -m pip install -e ".[test]" && python -m pytest -q -n 2',
        'python -m pip install -e ".[test,docs]" && python -m pytest -q -n 2 -m slow',
        "python -m mypy src",
        "bash .ci/installed",
    ]
    commands = [
        line
        for _, _, body in doc_blocks.fenced_blocks(readme)
        for line in body.splitlines()
        if line.strip()
    ]
    demo = 'python -m pip install -e ".[examples]" && python examples/rnn_exploding_gradients.py'
    for line in [demo, *ci[:-1]]:
        assert line in commands, f"README does not give the command {line!r}"
    assert ".ci/wheel" in readme, "README does not say that CI tests the installed wheel"
    assert ".ci/lowest" in readme, "README does not say that CI tests the lowest versions"
    installed = (ROOT / ".ci" / "installed").read_text()
    assert "bash .ci/wheel >" in installed and "bash .ci/lowest >" in installed


def test_the_lowest_versions_ci_tests_are_the_lower_bounds_pyproject_declares():
    """`.ci/lowest.txt` pins every runtime and test dependency at its lower bound in
    `pyproject.toml` (ruff and mypy aside: they run in CI's main environment), and nothing else;
    the README states the same floor."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for text in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(text)
        (spec,) = requirement.specifier
        assert spec.operator == ">=", f"{text}: a lower bound is expected"
        bounds[canonicalize_name(requirement.name)] = Version(spec.version)
    pins = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    assert pins == {name: v for name, v in bounds.items() if name not in ("ruff", "mypy")}
    readme = README.read_text()
    for name in ("jax", "jaxlib", "optax", "numpy"):
        assert f"`{name}` {bounds[name]}" in readme, f"README does not give {name}'s floor"


@pytest.mark.parametrize(
    "printed, expected, same",
    [
        ("50.0 [2.9999998 3.9999998] 50.0", "50.0 [3. 4.] 50.0", True),
        ("[1.2       1.5999999]", "[1.2 1.6]", True),
        ("loss 3.1381  skipped (overflow)", "loss 3.1380  skipped", False),
        ("loss 3.1381  scale 32768", "loss 3.1380  scale 32769", False),
        ("loss 3.2  scale 32768", "loss 3.1  scale 32768", False),
        ("[5.e+00 5.e+01 nan]", "[5.e+00 5.e+01 nan]", True),
        ("[5.e+00 5.e+01]", "[5.e+00 5.e+01 5.e+20]", False),
        ("-1.0", "1.0", False),
    ],
)
@pytest.mark.every_case
def test_a_gpus_output_may_differ_in_its_last_digits_only(printed, expected, same):
    assert same_but_digits(printed, expected) is same


def test_tests_sharing_a_module_fixture_go_to_one_process(request, several_devices):
    """Under pytest-xdist (`--dist=loadgroup`) a test that uses one of its module's
    module-scoped fixtures carries the module's group (conftest.py), so the fixture is set up
    in one process only; a test using none carries no group (see the next test)."""
    groups = [m.args for m in request.node.iter_markers("xdist_group")]
    assert groups == [("test_doc_blocks",)], groups
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "--dist=loadgroup" in options["ini_options"]["addopts"].split()


def test_a_test_sharing_no_module_fixture_has_no_group(request, tmp_path):
    """(`tmp_path` comes from a session-scoped fixture of pytest's own: no group.)"""
    assert not list(request.node.iter_markers("xdist_group"))


FEW = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def test_the_run_compiles_with_few_optimizations_as_its_environment_says():
    """`conftest._compile_with_few_optimizations`: the flag is the variable's value (set to
    1 unless the environment set it), and every process started inherits the variable."""
    import conftest

    assert os.environ[FEW].lower() in conftest._TRUTH
    assert (
        jax.config.values["jax_disable_most_optimizations"]
        is jax.config.values[conftest._FEW_KEY.name]  # (the key of JAX's caches mirrors it)
        is conftest._TRUTH[os.environ[FEW].lower()]
    )
    child = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.environ[{FEW!r}])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert child.stdout.strip() == os.environ[FEW]


def test_the_cycle_collector_runs_less_often_and_skips_what_collection_made():
    """`conftest._collect_garbage_less_often`: its thresholds in this test process, and the
    objects alive after collection frozen out of the collector's walks."""
    import gc

    assert gc.get_threshold() == (20_000, 20, 20)
    assert gc.get_freeze_count() > 0


def test_a_value_that_is_neither_true_nor_false_is_a_usage_error(monkeypatch):
    import conftest

    before = jax.config.values["jax_disable_most_optimizations"]
    monkeypatch.setenv(FEW, "sometimes")
    with pytest.raises(pytest.UsageError, match=f"{FEW}='sometimes' is neither true nor"):
        conftest._compile_with_few_optimizations()
    assert jax.config.values["jax_disable_most_optimizations"] is before  # (left as it was)


def test_as_users_compile_turns_the_optimizations_on_and_back():
    """`_users_compile`: JAX's optimizations on inside, for this process and the ones it
    starts, and the setting, its key and the variable as they were after, also when the test
    fails. A program compiled one way is not reused the other way, in either direction; nor is
    it compiled again when that way comes back (JAX's caches key on `_few_optimizations_key`).
    (`_compiling(True)` first: this module's blocks run under `as_users_compile_module`.)"""
    import conftest

    name, key = "jax_disable_most_optimizations", conftest._FEW_KEY.name
    x = np.ones((4, 8), np.float32)
    outside_first = jax.jit(lambda a: jnp.max(a, axis=0))
    inside_first = jax.jit(lambda a: jnp.max(a, axis=0))

    def call_both(few, sizes):
        """Both functions called with `few`'s setting, key and variable, leaving JAX's caches
        `sizes` entries; whether the program read is users' (a lone reduction in a fusion)."""
        assert (jax.config.values[name], jax.config.values[key]) == (few, few)
        assert os.environ[FEW] == ("1" if few else "0")
        for f in (outside_first, inside_first):
            f(x)
        assert (outside_first._cache_size(), inside_first._cache_size()) == sizes
        return " fusion(" in outside_first.lower(x).compile().as_text()

    wrapped = {}
    with conftest._compiling(True):
        outside_first(x)
        with pytest.raises(RuntimeError, match="inside"):
            with conftest._users_compile():
                wrapped["inside"] = call_both(False, (2, 1))
                raise RuntimeError("inside")
        wrapped["outside"] = call_both(True, (2, 2))
    if jax.default_backend() == "cpu":  # (`test_xlas_older_fusion_emitters_only_...`)
        assert wrapped == {"inside": True, "outside": False}


def test_xlas_older_fusion_emitters_only_with_few_optimizations():
    """`compile_setting`: a program compiled for a CPU with few optimizations asks XLA for its
    older fusion emitters (a lone reduction is then left unwrapped); one compiled as users'
    programs are does not, nor one compiled for an accelerator."""
    from _workers import compile_setting

    assert compile_setting.follow_few_optimizations(), (
        "JAX has no `jax._src.compiler.get_compile_options` any more: the tests run, without "
        "XLA's older fusion emitters; tests/_workers/compile_setting.py needs its new place"
    )
    x = jax.ShapeDtypeStruct((4, 8), np.float32)

    def compiled_text():
        return jax.jit(lambda a: jnp.max(a, axis=0)).lower(x).compile().as_text()

    def asked(backend):
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1, backend=backend)
        return dict(options.env_option_overrides).get(compile_setting.OPTION[0])

    import conftest

    cpu = jax.devices("cpu")[0].client
    for few, wrapped in ((True, False), (False, True)):
        with conftest._compiling(few):
            assert asked(cpu) == (False if few else None), few
            if jax.default_backend() == "cpu":
                assert (" fusion(" in compiled_text()) is wrapped, few
            else:  # (an accelerator's compile: the option is the CPU backend's only)
                assert asked(jax.devices()[0].client) is None, few
