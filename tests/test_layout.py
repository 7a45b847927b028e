"""The package's shape: small modules, short functions, imports in one direction only, and
prose (docstrings, comments) that says what and why, its measured numbers left to the design
pages.

A reader should be able to hold a module in their head and find each behaviour in one place.
The layers below are the order a module may import in: each module imports only modules of
earlier layers. A new module must be placed in a layer here (the test names it otherwise).
"""

import ast
import io
import pathlib
import pickle
import re
import tokenize

import jax
import numpy as np
import pytest

import optclip

# The package under test: the checkout's src/optclip, or the installed wheel's copy (CI runs the
# fast tier against the wheel too, so a module left out of the wheel fails here).
PACKAGE = pathlib.Path(optclip.__file__).resolve().parent

LAYERS = [
    ["_errors"],  # errors raised from a compiled step, and `reraise_errors`
    ["_checks"],  # argument validation and its messages
    ["_warn"],  # the warning for a threshold <= 0
    # norms/: the norm of leaves and trees, exact, over stacks, groups and devices
    ["norms.__init__"],  # its docstring: the subpackage's map
    ["norms._reductions"],  # norms from elementwise terms: fallback, batching, derivative rules
    ["norms._places"],  # where concrete arrays live outside `jit`
    ["norms._axes"],  # which mesh axes split each leaf
    ["norms._layers"],  # key paths; which leaves stack layers, and how the mesh splits them
    ["norms._groups"],  # which group each leaf is in
    ["norms._norms"],  # the norm of leaves and trees (stacking, buckets, devices)
    ["norms._scale"],  # the scale every clip shares, and its derivative
    # clips/: TensorFlow's functions and the Optax transformations
    ["clips.__init__"],
    ["clips._functional"],  # TensorFlow's clipping functions
    ["clips._steps", "clips._nonfinite"],  # state helpers; the non-finite policies
    ["clips._transforms"],  # the functions as Optax transformations
    ["clips._clipped"],  # Keras' optimizer arguments
    # guards/: the guards of a large run around any optimizer
    ["guards.__init__"],
    ["guards._accumulate", "guards._loss_scale", "guards._spikes"],  # the guards' rules
    ["guards._guarded"],  # `guarded`: the guards and the optimizer as one step
    # adaptive/: adaptive thresholds
    ["adaptive.__init__"],
    ["adaptive._adagc", "adaptive._agc", "adaptive._autoclip", "adaptive._zclip"],
    # per_example/: per-example (DP-SGD) clipping, and the ghost engine of `clipped_grad`
    ["per_example.__init__"],
    ["per_example._clips"],  # clipping of per-example gradients given
    ["per_example.ghost.__init__"],  # its docstring: the engine's map
    ["per_example.ghost._args"],  # `clipped_grad`'s arguments (jax_privacy's conventions)
    ["per_example.ghost._batch"],  # a call's settings, flat leaves, the examples' factors
    ["per_example.ghost._jaxprs"],  # reading the loss's jaxpr: calls, scans, gradient flow
    ["per_example.ghost._repeats"],  # the tapped pass with the stacks its scans write twice once
    ["per_example.ghost._views"],  # views of a parameter: shape-only operations, scalings
    ["per_example.ghost._target"],  # the platform a step is lowered for, decided once per step
    ["per_example.ghost._sites"],  # a use of a parameter: its kind and layout
    ["per_example.ghost._factors"],  # a use's per-example gradient as factors; Grams
    ["per_example.ghost._convs"],  # a convolution's patches and per-example products
    ["per_example.ghost._products"],  # a product site's batch sum written as one product
    ["per_example.ghost._rules"],  # the table of rules keyed by primitive
    ["per_example.ghost._trace"],  # where the parameters are used: sites and plans
    ["per_example.ghost._interpret"],  # the per-example loss evaluated with taps at the sites
    ["per_example.ghost._shared"],  # sites whose output gradients are equal: one tap for them
    ["per_example.ghost._pieces"],  # output gradients in pieces of taps, each scaled once
    ["per_example.ghost._plans"],  # each leaf's route: ghost or materialised; `force_route`
    ["per_example.ghost._norms"],  # each example's norm from the tapped pass
    ["per_example.ghost._sums"],  # the clipped sum by book-keeping (no second backward pass)
    ["per_example.ghost._materialised"],  # `method="vmap"`: every per-example gradient formed
    ["per_example.ghost._passes"],  # the ghost and the vmap passes: norms, weights, sum
    ["per_example.ghost._eager"],  # an eager call run as one compiled program
    ["per_example.ghost._api", "per_example.ghost._report"],  # `clipped_grad`; `ghost_report`
    ["_metrics"],  # every clip's state as one flat dict
    ["__init__"],  # the public names
]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80  # code lines of a function body, its docstring left out
MAX_TOP_LEVEL_MODULES = 12  # `.py` files at the top of the package, `__init__` included


def modules():
    """Every module, named by its path in the package: `_checks`, `norms._norms`,
    `per_example.ghost._trace`, `norms.__init__`."""
    return sorted(
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts) for path in PACKAGE.rglob("*.py")
    )


def path_of(name: str) -> pathlib.Path:
    return PACKAGE.joinpath(*name.split(".")).with_suffix(".py")


def layer_of(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise AssertionError(f"module `{name}` is in no layer of tests/test_layout.py: place it")


def named(dotted: str) -> str:
    """A module's name in `LAYERS` from its import path: "optclip.norms._axes" -> "norms._axes",
    a package ("optclip.norms") -> "norms.__init__"."""
    parts = dotted.split(".")[1:]
    if PACKAGE.joinpath(*parts).is_dir():
        parts.append("__init__")
    return ".".join(parts)


def imported(path: pathlib.Path) -> set:
    """The optclip modules `path` imports, named as in `LAYERS` (``from optclip.norms import
    _axes`` imports `norms._axes`; ``from optclip.norms._groups import GroupNorms`` too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path.name}: relative import; import `optclip...` by name")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "optclip":
            for alias in node.names:
                whole = f"{node.module}.{alias.name}"
                is_module = path_of(named(whole)).exists()
                out.add(named(whole if is_module else node.module))
        elif isinstance(node, ast.Import):
            out |= {named(a.name) for a in node.names if a.name.startswith("optclip.")}
    return out


@pytest.mark.every_case
@pytest.mark.parametrize("name", modules())
def test_module_is_small_and_imports_only_earlier_layers(name):
    path = path_of(name)
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name}.py has {lines} lines: split it by idea"
    here = layer_of(name)
    for other in imported(path):
        assert layer_of(other) < here, f"{name} imports {other}, which is not below it"


def body_lines(node) -> int:
    body = node.body
    if (
        len(body) > 1
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


@pytest.mark.every_case
@pytest.mark.parametrize("name", modules())
def test_functions_are_short(name):
    tree = ast.parse(path_of(name).read_text())
    long = [
        f"{node.name} ({body_lines(node)} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and body_lines(node) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{name}.py: functions over {MAX_FUNCTION_LINES} lines: {long}"


# A measured number in prose: a ratio (1.3x), a size or a duration (16 MiB, 4 ms, 2 s), a
# speed-up (70 times slower). Such numbers belong to the design pages and the benchmarks'
# results, beside the command that measured them; a docstring says what and why.
MEASURED = re.compile(
    r"\b\d+(?:\.\d+)?x\b"
    r"|\b\d+(?:\.\d+)?\s*(?:KiB|MiB|GiB|KB|MB|GB|ms|us|µs|s|min)\b"
    r"|\b\d+(?:\.\d+)?(?:\s*(?:to|-)\s*\d+(?:\.\d+)?)?\s*times\s+(?:faster|slower|the|as)\b"
)


def prose(text: str) -> list[tuple[int, str]]:
    """A module's docstrings and comments, each with its first line."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            out.append((token.start[0], token.string))
    return out


def test_measured_numbers_are_found_in_prose():
    text = '"""Faster: 1.3x the step."""\n\n\ndef f():\n    # 16 MiB, 70 times slower\n    pass\n'
    found = [m.group(0) for _, s in prose(text) for m in MEASURED.finditer(s)]
    assert found == ["1.3x", "16 MiB", "70 times slower"]
    shapes = "a (B, 3x3) kernel, bits 0x7f800000, 2 examples, 128x128 layers, float32"
    assert not MEASURED.findall(shapes)


@pytest.mark.every_case
@pytest.mark.parametrize("name", modules())
def test_docstrings_and_comments_hold_no_measured_numbers(name):
    text = path_of(name).read_text()
    found = [f"line {n}: {m.group(0)!r}" for n, s in prose(text) for m in MEASURED.finditer(s)]
    assert not found, f"{name}.py: measured numbers in prose (move them to docs/design): {found}"


def subpackage_of(name: str) -> str:
    """The top-level room of a module: "norms" for `norms._axes`, "" for `_checks`."""
    return name.split(".")[0] if "." in name and not name.startswith("__init__") else ""


@pytest.mark.every_case
def test_top_level_is_small_and_subpackages_form_one_stack():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top: {top}"
    # A subpackage's layers are contiguous: once the stack leaves a subpackage it never returns,
    # so the subpackages import one another in one direction too.
    rooms = [subpackage_of(layer[0]) for layer in LAYERS]
    for layer in LAYERS:
        assert len({subpackage_of(name) for name in layer}) == 1, f"{layer} spans subpackages"
    left = [
        room for i, room in enumerate(rooms) if room and room in rooms[:i] and rooms[i - 1] != room
    ]
    assert not left, f"subpackages split across the layers: {left}"
    assert sorted(sum(LAYERS, [])) == modules(), "LAYERS and the package's files differ"


# Every name `import optclip` offers: removing or renaming one breaks users' code.
PUBLIC_NAMES = [
    "AGCState", "AccumulationState", "AdaGCState", "AutoClipState", "AuxiliaryOutput",
    "AxisNameError", "ClippedGradFn", "ClippedState", "DynamicLossScale", "GhostReport",
    "GlobalClipState", "GroupNorms", "GuardedState", "LeafReport", "LossScaleState",
    "NonFiniteNormError", "ScheduleState", "SpikeSkip", "SpikeState", "ZClipState", "adagc",
    "agc", "autoclip", "average_norm_clip", "block_rms_clip", "check_split",
    "clip_by_average_norm", "clip_by_block_rms", "clip_by_global_norm", "clip_by_norm",
    "clip_by_value", "clipped", "clipped_grad", "force_ghost_route", "ghost_report",
    "global_clip", "global_norm", "guarded", "loss_scale", "metrics", "norm_clip",
    "per_example_clip", "per_example_layer_clip", "reraise_errors", "value_clip", "zclip",
]  # fmt: skip


def test_every_public_name_is_offered():
    assert sorted(optclip.__all__) == sorted(PUBLIC_NAMES)
    missing = [name for name in PUBLIC_NAMES if not hasattr(optclip, name)]
    assert not missing, f"listed in __all__ but not importable: {missing}"


def test_states_pickled_by_the_flat_layout_still_load():
    """tests/data/pickled_states.pkl holds every public state as the package pickled it when its
    modules were flat (`optclip._transforms.GlobalClipState`, ...): each loads as the same class,
    with the same structure and values as the state the same steps give now."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent / "data"))
    try:
        import record_pickled_states
    finally:
        sys.path.pop(0)
    blob = (pathlib.Path(__file__).parent / "data" / "pickled_states.pkl").read_bytes()
    assert b"optclip._transforms" in blob  # the old module paths, as recorded
    loaded, now = pickle.loads(blob), record_pickled_states.states()
    assert loaded.keys() == now.keys()
    for name in now:
        assert jax.tree.structure(loaded[name]) == jax.tree.structure(now[name]), name
        for old, new in zip(jax.tree.leaves(loaded[name]), jax.tree.leaves(now[name])):
            np.testing.assert_array_equal(old, new, err_msg=name)
