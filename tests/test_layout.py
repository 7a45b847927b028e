"""The package's shape: small modules, short functions, imports in one direction only.

A reader should be able to hold a module in their head and find each behaviour in one place.
The layers below are the order a module may import in: each module imports only modules of
earlier layers. A new module must be placed in a layer here (the test names it otherwise).
"""

import ast
import pathlib

import pytest

import optclip

# The package under test: the checkout's src/optclip, or the installed wheel's copy (CI runs the
# fast tier against the wheel too, so a module left out of the wheel fails here).
PACKAGE = pathlib.Path(optclip.__file__).resolve().parent

LAYERS = [
    ["_errors"],  # errors raised from a compiled step, and `reraise_errors`
    ["_checks"],  # argument validation and its messages
    ["_warn"],  # the warning for a threshold <= 0
    ["_norm_rules"],  # norms from elementwise terms: fallback, batching and derivative rules
    ["_places"],  # where concrete arrays live outside `jit`
    ["_axes"],  # which mesh axes split each leaf
    ["_layers"],  # key paths; which leaves stack layers, and how the mesh splits them
    ["_groups"],  # which group each leaf is in
    ["_norms"],  # the norm of leaves and trees (stacking, buckets, devices)
    ["_scale"],  # the scale every clip shares, and its derivative
    ["_functional"],  # TensorFlow's clipping functions
    ["_per_example"],  # per-example (DP-SGD) clipping
    ["_steps", "_nonfinite"],  # state helpers; the non-finite policies
    ["_accumulate", "_loss_scale", "_spikes"],  # the guards' rules: accumulation, scale, spikes
    ["_transforms"],  # the functions as Optax transformations
    ["_clipped"],  # Keras' optimizer arguments
    ["_guarded"],  # the guards of a large run around any optimizer
    ["_adagc", "_agc", "_autoclip", "_zclip"],  # adaptive thresholds
    ["_metrics"],  # every clip's state as one flat dict
    # The ghost-clipping subpackage (`optclip/ghost/`): on top of the flat modules, below the
    # public names; nothing outside it imports it but `__init__`.
    ["ghost.__init__"],  # its docstring: the engine's map
    ["ghost._args"],  # `clipped_grad`'s arguments (jax_privacy's conventions), checked
    ["ghost._batch"],  # a call's settings, its arguments as flat leaves, the examples' factors
    ["ghost._jaxprs"],  # reading the loss's jaxpr: calls, scans, where the gradient flows
    ["ghost._views"],  # views of a parameter: shape-only operations, scalings, scan entries
    ["ghost._target"],  # the platform a step is lowered for, decided once per step
    ["ghost._sites"],  # a use of a parameter: its kind and layout
    ["ghost._factors"],  # a use's per-example gradient as factors; Grams; powers of two
    ["ghost._products"],  # a product site's batch sum written as one product
    ["ghost._rules"],  # the table of rules keyed by primitive
    ["ghost._trace"],  # where the parameters are used: sites and plans (the jaxpr walk)
    ["ghost._interpret"],  # the per-example loss evaluated with taps at the sites
    ["ghost._plans"],  # each leaf's route: ghost or materialised; `force_route`
    ["ghost._norms"],  # each example's norm from the tapped pass
    ["ghost._sums"],  # the clipped sum by book-keeping (no second backward pass)
    ["ghost._materialised"],  # `method="vmap"`: every per-example gradient formed
    ["ghost._passes"],  # the ghost and the vmap passes: norms, weights, clipped sum
    ["ghost._eager"],  # an eager call run as one compiled program
    ["ghost._api", "ghost._report"],  # `clipped_grad`; `ghost_report`
    ["__init__"],  # the public names
]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80  # code lines of a function body, its docstring left out


SUBPACKAGES = ["ghost"]


def modules():
    """Every module: the flat ones by name (`_norms`), a subpackage's as `ghost._trace`."""
    flat = [path.stem for path in PACKAGE.glob("*.py")]
    nested = [f"{sub}.{path.stem}" for sub in SUBPACKAGES for path in (PACKAGE / sub).glob("*.py")]
    return sorted(flat + nested)


def path_of(name: str) -> pathlib.Path:
    return PACKAGE / (name.replace(".", "/") + ".py")


def layer_of(name: str) -> int:
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise AssertionError(f"module `{name}` is in no layer of tests/test_layout.py: place it")


def imported(path: pathlib.Path) -> set:
    """The optclip modules `path` imports (``from optclip import _x``, ``from optclip._x``,
    ``from optclip.ghost import _y``, ``from optclip.ghost._y``), named as in `LAYERS`."""
    out = set()

    def named(dotted: str) -> str:  # "optclip._x" -> "_x", "optclip.ghost._y" -> "ghost._y"
        parts = dotted.split(".")[1:]
        if parts[0] in SUBPACKAGES:
            return ".".join(parts[:2]) if len(parts) > 1 else f"{parts[0]}.__init__"
        return parts[0]

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path.name}: relative import; import `optclip...` by name")
        if isinstance(node, ast.ImportFrom) and node.module == "optclip":
            out |= {named(f"optclip.{alias.name}") for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module in {
            f"optclip.{s}" for s in SUBPACKAGES
        }:
            out |= {named(f"{node.module}.{alias.name}") for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("optclip."):
            out.add(named(node.module))
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
