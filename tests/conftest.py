"""Shared fixtures, and the two test tiers.

``python -m pytest -q -n 2`` runs the fast tier: every test, with one case of each parametrized
test (its first case that runs under `jit`), and the 8-device worker's sections but its slowest
(`_workers/launch.py`). ``python -m pytest -q -n 2 -m slow`` runs everything else: the other
cases (eager runs, every dtype and size), those sections, the multi-process checks, the example
scripts, the benchmark smoke run and the documentation build. CI runs both. ``-n 2`` (pytest-xdist)
runs the tests in two processes, since one keeps about one core busy; without it they run in
this one.
"""

import contextlib
import gc
import os
import shutil
import tempfile

import jax
import pytest
from _workers import compile_setting, launch

_CACHE = "JAX_COMPILATION_CACHE_DIR"
_OWN_CACHE: list[str] = []  # (the cache this run made, removed when it ends)


def _share_compiles_within_the_run():
    """One persistent compilation cache for the whole run, unless one is set already (CI sets one
    for all its stages): the test processes of ``-n 2``, the 8-device workers and the scripts the
    tests start compile many of the same programs, and each then reads what the first wrote. The
    cache is a fresh folder, removed when the run ends, so no run sees another's programs.
    (pytest-xdist's processes and every subprocess inherit the environment; this process imported
    JAX already, so it is told through `jax.config`.)"""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(_CACHE):
        return
    folder = tempfile.mkdtemp(prefix="optclip-compiles-")
    _OWN_CACHE.append(folder)
    os.environ[_CACHE] = folder
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


_FEW_OPTIMIZATIONS = "JAX_DISABLE_MOST_OPTIMIZATIONS"
_TRUTH = {"y": True, "yes": True, "t": True, "true": True, "on": True, "1": True}
_TRUTH.update({"n": False, "no": False, "f": False, "false": False, "off": False, "0": False})


def _few_optimizations_key():
    """A setting that mirrors ``jax_disable_most_optimizations`` in the key of JAX's caches of
    traced and compiled programs (``include_in_jit_key``, as JAX makes ``jax_enable_x64``;
    through JAX's private `jax._src.config`). JAX's in-memory caches do not key on that flag
    (its persistent cache does, through the compile's options). With the mirror, a program
    compiled as users compile and one compiled with few optimizations are two entries: neither
    is reused the other way, and neither is compiled again when the tests switch back."""
    from jax._src import config

    name = "optclip_tests_few_optimizations"
    try:
        known = config.config_states.get(name)
        if known is not None:  # (conftest imported again, by a test that reads it)
            return known
        return config.bool_state(
            name,
            False,
            help="optclip's tests: jax_disable_most_optimizations, in JAX's cache keys.",
            include_in_jit_key=True,
            include_in_trace_context=True,
        )
    except (AttributeError, TypeError) as error:
        raise pytest.UsageError(
            "tests/conftest.py: JAX's private `jax._src.config` has no `config_states` or "
            f"`bool_state(..., include_in_jit_key=...)` any more ({error}); the tests' key of "
            "their compile setting needs its new place"
        ) from error


_FEW_KEY = _few_optimizations_key()


def _set_few_optimizations(few: bool):
    """How this process compiles, in the one place that sets it: JAX's flag, and the key of
    JAX's caches that mirrors it (`_few_optimizations_key`)."""
    jax.config.update("jax_disable_most_optimizations", few)
    jax.config.update(_FEW_KEY.name, few)


def _compile_with_few_optimizations():
    """The tests' programs compiled with JAX's ``jax_disable_most_optimizations`` (LLVM's
    optimizations off, for code whose compile costs more than its run) and XLA's older fusion
    emitters on a CPU (`compile_setting`), unless the environment sets
    ``JAX_DISABLE_MOST_OPTIMIZATIONS`` itself (``=0``: as users compile). Values agree with
    users' to rounding. A test of the same bits from two programs, of a compiled program's text
    or memory, or of printed output against what a page quotes, compiles as users' programs do
    (`as_users_compile`, `as_users_compile_module`). Every subprocess inherits the setting; the
    8-device workers follow it too."""
    value = os.environ.setdefault(_FEW_OPTIMIZATIONS, "1")
    if value.lower() not in _TRUTH:
        raise pytest.UsageError(f"{_FEW_OPTIMIZATIONS}={value!r} is neither true nor false")
    _set_few_optimizations(_TRUTH[value.lower()])
    compile_setting.follow_few_optimizations()


@contextlib.contextmanager
def _compiling(few: bool):
    """This process, and the processes started meanwhile, compile with few optimizations (or
    as users do); the setting, its key and the variable as they were after."""
    before = jax.config.values["jax_disable_most_optimizations"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_FEW_OPTIMIZATIONS, "1" if few else "0")
        _set_few_optimizations(few)
        try:
            yield
        finally:
            _set_few_optimizations(before)


def _users_compile():
    """JAX's optimizations on, here and in the processes started meanwhile; the programs
    traced and compiled meanwhile cached under a key of their own, so that no program compiled
    the other way is reused, in either direction."""
    return _compiling(False)


@pytest.fixture
def as_users_compile():
    """The test compiles as users' programs do, with JAX's optimizations: it checks the same
    bits from two programs (LLVM's optimizations may round one of them otherwise)."""
    with _users_compile():
        yield


@pytest.fixture(scope="module")
def as_users_compile_module():
    """The module's tests, and the processes they start, compile with JAX's optimizations: they
    check printed output against what a page quotes."""
    with _users_compile():
        yield


def _collect_garbage_less_often():
    """Python's cycle collector run less often in the test processes. JAX's caches of traced
    and compiled programs hold hundreds of thousands of objects that live to the end of the
    run. With the default thresholds (700, 10, 10), the tests' tracing sets off a full
    collection, which walks all of them, every few seconds. Larger thresholds count more
    allocations not yet freed before each collection, so cycles are still collected, in
    larger batches. The objects alive when collection ends are also frozen (`gc.freeze`, in
    `pytest_collection_finish`), out of every later walk. What it saves is in
    docs/design/tests-and-ci.md."""
    gc.set_threshold(20_000, 20, 20)


def pytest_configure(config):
    """One compilation cache for the run (`_share_compiles_within_the_run`), programs compiled
    with few optimizations (`_compile_with_few_optimizations`), the cycle collector run less
    often (`_collect_garbage_less_often`). On a GPU or TPU
    the tests' matrix products are float32's, as on a CPU: JAX's default precision there is
    TF32 or bfloat16, and the tests compare with float64 references at float32's tolerances.
    (A test of what a precision does sets it itself; a precision set in the environment,
    ``JAX_DEFAULT_MATMUL_PRECISION``, is kept.)"""
    if jax.config.jax_default_matmul_precision is None and jax.default_backend() != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")
    _share_compiles_within_the_run()
    _compile_with_few_optimizations()
    _collect_garbage_less_often()


@pytest.fixture(params=["eager", "jit"])
def mode(request):
    """Runs a test once eagerly and once under `jax.jit`."""
    return request.param


@pytest.fixture
def strict_promotion():
    """optclip's own code under strict dtype promotion: a silent upcast is an error.

    (Optax's optimizers are not written for strict promotion, so tests that run them don't
    use this.)
    """
    with jax.numpy_dtype_promotion("strict"):
        yield


def _representative(items):
    """The one case of a parametrized test that the fast tier runs: the first that is not run
    eagerly (eager cases cost the most and the jit path is the one training code takes)."""
    for item in items:
        if "eager" not in item.callspec.id.split("-"):
            return item
    return items[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks every case of a parametrized test but one as `slow` (unless the test is marked
    `every_case`: cheap cases sharing one expensive fixture)."""
    cases: dict = {}
    for item in items:
        if getattr(item, "callspec", None) is None or item.get_closest_marker("every_case"):
            continue
        cases.setdefault((item.path, item.originalname), []).append(item)
    for group in cases.values():
        keep = _representative(group)
        for item in group:
            if item is not keep:
                item.add_marker(pytest.mark.slow)
    _shared_fixture_groups(items)


def _shared_fixture_groups(items):
    """Under pytest-xdist (``--dist loadgroup``, pyproject.toml's addopts) the tests of a module
    that use one of its module-scoped fixtures (a documentation build, the examples' runs, the
    8-device workers' results) go to one process, so that each fixture is set up once. (pytest's
    own and plugins' fixtures have no `baseid`: `tmp_path_factory` groups nothing.)"""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d[-1].baseid and d[-1].scope in ("module", "session") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


def pytest_collection_finish(session):
    """Starts the 8-device workers now that selected tests need (each runs on the second core
    while the tests before it run on the first). Under pytest-xdist every process collects every
    test, so there the fixture that reads a worker's result starts it instead, in the one
    process its tests go to. In every process, what collection made is frozen out of the cycle
    collector's walks (`_collect_garbage_less_often`)."""
    gc.collect()
    gc.freeze()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "multidevice" in needed:
        launch.start_multidevice(launch.multidevice_sections(session.items))
    if "ghost_multidevice" in needed:
        launch.start_ghost_multidevice()


def pytest_sessionfinish(session, exitstatus):
    launch.stop_all()


def pytest_unconfigure(config):
    for folder in _OWN_CACHE:
        shutil.rmtree(folder, ignore_errors=True)
