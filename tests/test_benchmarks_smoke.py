"""The benchmark suite runs end to end (``--quick``) and prints its table.

No timing is asserted: the machine is shared and noisy. Only the accuracy figures, which are
deterministic, are checked against the contract (float32 rounding for any leaf count).
"""

import contextlib
import functools
import io
import json
import os
import platform
import subprocess
import sys
import unittest.mock
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from reference import equations
from reference import load_benchmark as load

import optclip

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_suite_runs_and_prints_table(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,  # (95-125 s on the shared 2 cores under load; a hang still fails)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "benchmark" in proc.stdout and "ratio" in proc.stdout, proc.stdout
    assert "targets met" in proc.stdout, proc.stdout

    results = json.loads(out.read_text())
    sections = {row["section"] for row in results["rows"]}
    assert sections == {
        "step",
        "overhead",
        "norm",
        "many_leaves",
        "bf16",
        "per_example",
        "groups",
        "adaptive",
        "loss_scaling",
        "memory",
        "accuracy",
    }, sections
    per_example = [row["name"] for row in results["rows"] if row["section"] == "per_example"]
    for kind in ("run", "compile"):  # the per-example functions against optax's
        for fn in ("per_example_clip", "per_example_layer_clip"):
            assert any(name.startswith(f"{fn} {kind}, ") for name in per_example), per_example
    passes = [r for r in results["rows"] if r["section"] == "loss_scaling" and r["unit"] == "n"]
    assert len(passes) == 1 and passes[0]["passed"], passes  # (a structural count, not timing)
    assert passes[0]["ours"] < passes[0]["ref"], passes
    assert results["machine"]["cpu"], results["machine"]
    accuracy = [row for row in results["rows"] if row["section"] == "accuracy"]
    assert len(accuracy) == 6  # {bfloat16, float16} x {10, 100, 1000} leaves
    for row in accuracy:
        assert row["ours"] <= 1e-6, row


@pytest.mark.slow
def test_versions_comparison_runs_against_an_earlier_commit():
    """`benchmarks/versions.py` imports the package at a git commit beside the working tree's
    and prints one ratio per row (needs the repository's history: skipped in a copy without
    it, as the wheel's test run is)."""
    if not (ROOT / ".git").exists():
        pytest.skip("no git history here")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "versions.py"), "HEAD", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "optclip at HEAD" in lines[0] and "x " in lines[0], lines[0]  # the machine named
    rows = [line for line in lines[2:] if line.strip()]
    names = [row.split(",")[0] for row in rows]
    assert names == ["global_norm"] * 2 + ["global_clip+adam step"] * 2, rows
    for row in rows:  # ratio, its IQR, and both medians (no bound on them: they are timings)
        ratio, spread, new, base = row.split()[-4:]
        assert float(ratio) > 0 and "-" in spread, row
        assert new.endswith("ms") and base.endswith("ms"), row


# Scripts run in a process of their own, bounded in time: `compile.py` and `compile_parts.py`
# clear JAX's caches (the later tests of this process would trace again), `private_eager.py`
# starts processes of its own, and `compile_phases.py` sets XLA's logging before JAX starts.
# The others run in the test's process (their `main`, `sys.argv` theirs): a process of their
# own would spend 5 s or more on its imports.
OWN_PROCESS = (
    "compile.py",
    "profile/private_eager.py",
    "profile/compile_phases.py",
    "profile/compile_parts.py",
)


def run_private(tmp_path, *args, script="private.py"):
    """The rows `benchmarks/<script>` writes with `args` (bounded where in a process of its
    own)."""
    out = tmp_path / "private.json"
    argv = [str(ROOT / "benchmarks" / script), *args, "--json", str(out)]
    if script in OWN_PROCESS:
        proc = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    else:
        with (
            contextlib.chdir(ROOT),
            unittest.mock.patch.object(sys, "argv", argv),
            unittest.mock.patch.object(sys, "path", list(sys.path)),  # (its folders added)
        ):
            load(script).main(argv[1:])
    data = json.loads(out.read_text())
    saved = (
        "private.py",
        "compile.py",
        "recurrent.py",
        "profile/compile_phases.py",
        "profile/compile_parts.py",
    )
    if script not in saved:
        return data  # (the profilers write their rows alone)
    # A run as benchmarks/results/ keeps it: the command that made it and the machine.
    assert data["command"].startswith("python ") and "--json" in data["command"], data["command"]
    assert "jax" in data["machine"], data["machine"]
    return data["rows"]


@pytest.mark.slow
def test_private_training_benchmark_runs_and_plots(tmp_path):
    """benchmarks/private.py --quick: every method at both batch sizes of both models, memory
    from the compiled programs (structural: the materialising methods need more than ghost
    clipping on the MLP, whose per-example gradients dwarf its activations), and a plot."""
    plot = tmp_path / "private.svg"
    rows = run_private(tmp_path, "--quick", "--plot", str(plot))
    methods = {"jax.grad (non-private)", "optclip.clipped_grad", "jax_privacy.clipped_grad"}
    methods.add("vmap(grad) + per_example_clip")
    for model in ("transformer", "mlp"):
        for batch in (4, 8):
            got = {r["method"]: r for r in rows if r["model"] == model and r["batch"] == batch}
            assert set(got) == methods, got
            assert all("time_s" in r and "time_ratio" in r for r in got.values())
            assert got["optclip.clipped_grad"]["vs_jax_privacy"] > 0
            assert all("time_iqr" in r for m, r in got.items() if m != "jax.grad (non-private)")
    for batch in (4, 8):
        mlp = {
            r["method"]: r["peak_bytes"]
            for r in rows
            if r["model"] == "mlp" and r["batch"] == batch
        }
        assert mlp["optclip.clipped_grad"] < mlp["vmap(grad) + per_example_clip"], mlp
    svg = plot.read_text()  # (matplotlib writes each text of the figure as a comment)
    for label in methods | {"transformer", "mlp", "batch size"}:
        assert label in svg, label


def test_the_speed_guide_shows_the_saved_private_runs():
    """The speed guide's private-training tables are the saved runs'
    (`benchmarks/results/private_cpu.json`, `private_h200.json`, `private_h100.json`,
    `private_h100_pinned.json` and `private_convnet_cpu.json`, the rows `private.py --json`
    wrote, with the command and the machine), as `private.py --markdown` prints them, and its
    figure names every method and model."""
    bench = load("private.py")
    guide = (ROOT / "docs" / "guides" / "speed.md").read_text(encoding="utf-8")
    every = (16, 64, 256)
    runs = {  # (a CPU's, an H200's, an H100's: the transformer only; the last at 256 only;
        # the CPU's convnet)
        "private_cpu.json": (("transformer", "mlp"), every),
        "private_h200.json": (("transformer", "mlp"), every),
        "private_h100.json": (("transformer",), every),
        "private_h100_pinned.json": (("transformer",), (256,)),
        "private_convnet_cpu.json": (("convnet",), (16, 64)),
    }
    for run, (models, batches) in runs.items():
        saved = json.loads((ROOT / "benchmarks" / "results" / run).read_text())
        assert saved["command"] and saved["machine"], run
        rows = bench.load_rows(ROOT / "benchmarks" / "results" / run)
        assert bench.markdown(rows) in guide, run
        assert {(r["model"], r["batch"]) for r in rows} == {(m, b) for m in models for b in batches}
    svg = (ROOT / "docs" / "_static" / "private_memory.svg").read_text()
    for label in {r["method"] for r in rows} | {"transformer", "mlp", "batch size"}:
        assert label in svg, label


@pytest.mark.slow
def test_private_benchmark_runs_the_methods_and_batches_asked_for(tmp_path):
    rows = run_private(tmp_path, "--quick", "--only", "mlp", "--batches", "4", "--methods", "ghost")
    assert {(r["model"], r["batch"], r["method"]) for r in rows} == {
        ("mlp", 4, "jax.grad (non-private)"),
        ("mlp", 4, "optclip.clipped_grad"),
    }


@pytest.mark.slow
def test_the_recurrent_benchmark_measures_the_ghost_step_beside_the_non_private_one(tmp_path):
    """benchmarks/recurrent.py --quick --only eqx-gru --methods ghost: the Equinox GRU
    classifier's non-private step (every ratio 1.0) and ghost step at the quick batch, each
    with its memory and time as ratios, and what `ghost_report` says `clipped_grad`
    materialises (the cell's two biases, 3 x 128 and 128, and the head's 10: structural, no
    timing); `--markdown` prints the saved run's table."""
    args = ("--quick", "--only", "eqx-gru", "--methods", "ghost")
    rows = run_private(tmp_path, *args, script="recurrent.py")
    by = {(r["model"], r["batch"], r["method"]): r for r in rows}
    plain, ghost = (
        ("eqx-gru", 16, "jax.grad (non-private)"),
        ("eqx-gru", 16, "optclip.clipped_grad"),
    )
    assert set(by) == {plain, ghost}, rows
    assert by[plain]["peak_ratio"] == by[plain]["time_ratio"] == 1.0, by[plain]
    assert by[ghost]["peak_ratio"] > 0 and by[ghost]["time_ratio"] > 0, by[ghost]
    for r in rows:
        assert r["materialised"] == 3 and r["materialised_params"] == 3 * 128 + 128 + 10, r
        assert r["first_materialised"].startswith(".cell.bias: elementwise `add`"), r
    table = load("recurrent.py").markdown(rows)
    assert "| eqx-gru, 16 | " in table and "| 3 (522 params) | .cell.bias: " in table, table


def test_every_recurrent_model_is_set_up_and_its_weights_go_ghost():
    """benchmarks/recurrent.py's models (its `MODELS`, which `private_parts.py --recurrent`
    offers too) are each set up by `setups`, and `ghost_report` keeps every weight of more
    than one dimension of more than one entry ghost (only biases and GroupNorm scales are
    materialised)."""
    bench = load("recurrent.py")
    shape = bench.Shape(seq=4, hidden=8, features=4, vocab=16, width=8, size=8, channels=8)
    setups = bench.setups(shape)
    assert list(setups) == bench.MODELS
    for name, (loss, params, batch_of) in setups.items():
        report = optclip.ghost_report(loss, params, batch_of(2))
        leaves = jax.tree.leaves(params)
        for (path, r), leaf in zip(report.items(), leaves, strict=True):
            vector = sum(n > 1 for n in leaf.shape) < 2  # (a bias, a scale: (C, 1, 1) too)
            assert vector or r.mode == "ghost", (name, path, r)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["frozen", "scaled", "tied", "traced"])
def test_the_frozen_embedding_benchmark_sizes_every_method(tmp_path, model):
    """benchmarks/profile/private_frozen.py --quick: each method's compiled memory at the
    batch asked for, as a ratio to the non-private step; the ghost step forms no per-example
    copy of the frozen table, nor of the weights scaled by muP's numbers (`--model scaled`;
    `traced`, the multiplier an argument of the step; `tied`, the table scaled by one number as
    the output layer and by none as the lookup), which the materialising `vmap` step does."""
    args = ("--quick", "--batches", "4", "--model", model)
    rows = run_private(tmp_path, *args, script="profile/private_frozen.py")
    by = {r["method"]: r for r in rows}
    assert set(by) == {
        "jax.grad (non-private)",
        "optclip.clipped_grad",
        "jax_privacy.clipped_grad",
        "vmap(grad) + per_example_clip",
    }
    assert {r["batch"] for r in rows} == {4} and by["jax.grad (non-private)"]["ratio"] == 1.0
    if model == "tied":  # (at --quick's sizes the 64 x 8 table's copies weigh less than the
        # logits, so the memory claim is the full size's, in docs/design/ghost-costs.md: here,
        # that the table the benchmark measures goes ghost, scaled by two numbers, no copy per
        # example)
        import optclip

        loss, params = load("profile/private_frozen.py").tied_model(64, 8, 6)
        report = optclip.ghost_report(loss, params, jnp.zeros((4, 6), jnp.int32))
        assert {r.mode for r in report.values()} == {"ghost"}, report
        assert "its own number (1, 0.125)" in report["['embed']"].reason, report
        return
    assert (
        by["optclip.clipped_grad"]["peak_bytes"] < by["vmap(grad) + per_example_clip"]["peak_bytes"]
    )


@pytest.mark.slow
def test_the_eager_benchmark_times_each_method_in_a_process_of_its_own(tmp_path):
    """benchmarks/profile/private_eager.py --quick: each method's first eager call and a warm
    one, on both models, each a ratio to the non-private call's."""
    rows = run_private(tmp_path, "--quick", "--warm", "1", script="profile/private_eager.py")
    methods = ["optclip.clipped_grad", "jax_privacy.clipped_grad", "jax.grad (non-private)"]
    assert [(r["model"], r["method"]) for r in rows] == [
        (model, m) for model in ("mlp", "transformer") for m in methods
    ]
    for r in rows:
        assert r["first_s"] > 0 and r["warm_s"] > 0, r
        if r["method"] == "jax.grad (non-private)":
            assert r["first_ratio"] == r["warm_ratio"] == 1.0
    why = "--warm and --batch must be at least 1"
    refused("--warm", "0", why=why, script="profile/private_eager.py")


@pytest.mark.slow
def test_the_ghost_steps_parts_are_timed_with_each_part_taken_out(tmp_path):
    """benchmarks/profile/private_parts.py --quick: the step as it is, with its norms or its
    sums taken out, and by each route and loop (the script checks each variant's norms),
    next to the non-private step; --grams: the output layer's Gram three ways, the same
    values; --mlp: the same parts on the MLP (not with --grams), two of them by --variants;
    --products: the MLP's first clipped-sum product three ways (the script checks they
    agree); --recurrent: a model of benchmarks/recurrent.py in its place."""
    rows = run_private(tmp_path, "--quick", script="profile/private_parts.py")
    assert [r["variant"] for r in rows] == [
        "jax.grad (non-private)",
        "ghost",
        "norms at 1",
        "sums of 0",
        "tapped pass only",
        "Grams only",
        "direct products",
        "norms one example at a time",
        "norms batched",
        "output gradients unpinned",
        "output gradients all pinned",
        "Grams at HIGHEST",
        "convolutions' sums together",
        "convolutions' products not formed",
        "scans' steps kept whole",
        "scans' products kept",
        "scans' repeated stacks kept",
    ]
    assert all(r["time_s"] > 0 for r in rows) and all("time_ratio" in r for r in rows[1:])
    rows = run_private(tmp_path, "--quick", "--grams", script="profile/private_parts.py")
    ways = ["one batched product", "two halves", "one example at a time"]
    assert [r["way"] for r in rows] == ways
    runs = [  # (the model's arguments, the batch, the variants beside the non-private step)
        (("--mlp", "--pairs", "1"), 8, ["ghost", "norms one example at a time"]),
        (("--convnet", "--memory"), 2, ["ghost", "convolutions' products not formed"]),
        (("--recurrent", "jax-lstm", "--memory"), 2, ["ghost"]),
    ]
    for args, batch, variants in runs:
        rows = run_private(
            tmp_path,
            *(*args, "--batches", str(batch), "--variants", *variants),
            script="profile/private_parts.py",
        )
        want = [("jax.grad (non-private)", batch), *((v, batch) for v in variants)]
        assert [(r["variant"], r["batch"]) for r in rows] == want
        assert "--memory" not in args or all(r["peak_bytes"] > 0 for r in rows)
    refused("--variants", "norms", why="argument --variants: invalid choice: 'norms'")
    refused("--mlp", "--grams", why="--grams times the transformer's output layer")
    why = "--mlp, --convnet, --recurrent, --grams and --products each choose the model: one"
    refused("--mlp", "--convnet", why=why)
    refused("--recurrent", "jax-lstm", "--products", why=why)
    rows = run_private(
        tmp_path, "--quick", "--products", "--batches", "8", script="profile/private_parts.py"
    )
    ways = ["A^T G (non-private)", "VJP of the batch", "written out"]
    assert [(r["way"], r["batch"]) for r in rows] == [(way, 8) for way in ways]
    refused("--products", "--mlp", why="--products times the MLP's first layer")


@pytest.mark.slow
def test_the_steps_device_time_is_profiled_by_source_line(tmp_path):
    """private_parts.py --kernels: both steps profiled, their device time per call summed by
    the source line of each compiled instruction: the model's own lines are named in both
    steps (the tapped pass keeps them), the engine's in the ghost step only."""
    rows = run_private(
        tmp_path, "--quick", "--kernels", "--top", "400", script="profile/private_parts.py"
    )
    total, lines = rows[0], rows[1:]
    assert total["line"] == "(all)" and total["ghost_s"] > 0 and total["plain_s"] > 0
    assert all(r["batch"] == 8 for r in rows) and len(lines) > 10
    model = [r for r in lines if r["line"].startswith("_private_models.py:")]
    assert any(r["ghost_s"] > 0 for r in model) and any(r["plain_s"] > 0 for r in model)
    engine = [r for r in lines if r["line"].split(":")[0] in ("_factors.py", "_sums.py")]
    assert engine and all(r["plain_s"] == 0 for r in engine), engine
    assert sum(r["ghost_s"] for r in lines) == pytest.approx(total["ghost_s"])
    refused("--kernels", "--flops", why="--kernels profiles the two steps")


@pytest.mark.slow
def test_the_steps_page_faults_are_counted(tmp_path):
    """private_parts.py --faults: each step's minor page faults per call, as pages, beside its
    temporaries. A compiled step run again touches at most its temporaries' pages and a few
    more (its outputs, the runtime's bookkeeping): a count that took in the compile, or the
    calls' total, would be above that."""
    import resource

    args = ("--quick", "--faults", "--variants", "ghost", "norms at 1")
    rows = run_private(tmp_path, *args, "--pairs", "4", script="profile/private_parts.py")
    names = [r["variant"] for r in rows]
    assert names == ["jax.grad (non-private)", "ghost", "norms at 1"], names
    for r in rows:
        assert r["batch"] == 8 and r["temp_bytes"] > 0, r
        assert r["faulted_bytes"] == r["faults"] * resource.getpagesize(), r
        assert 0 <= r["faulted_bytes"] <= r["temp_bytes"] + 2**22, r
    refused("--faults", "--memory", why="--faults counts the steps' page faults")


def test_page_faults_are_refused_where_they_are_not_counted(monkeypatch):
    """private_parts.py --faults on a platform without `resource` (Windows) is an argparse
    error that says why, not an ImportError after the model is built."""
    parts = load("profile/private_parts.py")
    monkeypatch.setattr(parts, "faults_counted", lambda: False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        parts.main(["--quick", "--faults"])
    assert exited.value.code == 2 and "POSIX only" in err.getvalue(), err.getvalue()


@pytest.mark.slow
def test_the_ghost_steps_arithmetic_is_counted(tmp_path):
    """private_parts.py --flops: each variant's matrix-product operations from its jaxpr. The
    step with its norms taken out does the non-private step's products (the clipped sums are
    the weight gradients' products, weighted), so the norms are the whole difference; the
    tapped pass alone does fewer than the step without its sums; a forced route may do other
    products than the route chosen."""
    rows = run_private(tmp_path, "--quick", "--flops", script="profile/private_parts.py")
    ratios = {r["variant"]: r.get("flop_ratio") for r in rows}
    variants = ["ghost", "norms at 1", "sums of 0", "tapped pass only", "Grams only"]
    variants += ["direct products"]
    variants += ["norms one example at a time", "norms batched", "output gradients unpinned"]
    variants += ["output gradients all pinned", "Grams at HIGHEST", "convolutions' sums together"]
    variants += ["convolutions' products not formed", "scans' steps kept whole"]
    variants += ["scans' products kept", "scans' repeated stacks kept"]
    assert list(ratios) == ["jax.grad (non-private)", *variants]
    assert 1.0 <= ratios["norms at 1"] < 1.01, ratios
    forced = ("Grams only", "direct products")  # (other products than the route chosen)
    parts = ("norms at 1", "sums of 0", "tapped pass only")
    same = {ratios[v] for v in variants if v not in (*parts, *forced)}
    assert len(same) == 1 and ratios["ghost"] > 1.05, ratios
    assert ratios["direct products"] != ratios["ghost"], ratios  # (the tiny model's: Grams)
    assert ratios["sums of 0"] < 1.0, ratios
    assert ratios["tapped pass only"] < ratios["sums of 0"], ratios  # (no Gram either)
    refused("--flops", "--grams", why="--flops counts the steps' parts")


def test_the_highest_variant_computes_the_grams_at_highest():
    """private_parts.py's ``Grams at HIGHEST`` swaps the engine's choice of the Grams'
    precision: a product at bfloat16 gets its Grams at HIGHEST there, at bfloat16 in
    ``ghost``."""
    parts = load("profile/private_parts.py")
    loss = lambda w, x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    w, x = jnp.ones((3, 4)), jnp.ones((2, 5, 3))
    found = {}
    for name in ("ghost", "Grams at HIGHEST"):
        step = optclip.clipped_grad(loss, l2_clip_norm=1.0)
        with parts.swapped(parts.VARIANTS[name]), jax.default_matmul_precision("bfloat16"):
            jaxpr = jax.make_jaxpr(step)(w, x).jaxpr
        found[name] = {
            eqn.params["precision"][0]
            for eqn in equations(jaxpr)
            if eqn.primitive.name == "dot_general"
            and [len(v.aval.shape) for v in eqn.invars] == [5, 5]
        }
    assert found == {"ghost": {lax.Precision.DEFAULT}, "Grams at HIGHEST": {lax.Precision.HIGHEST}}


def test_the_unpinned_variant_leaves_the_output_gradients_layout_to_xla():
    """private_parts.py's ``output gradients unpinned`` drops the row-major layout constraint
    that the step, lowered for a GPU, puts on the output gradient at its tapped site."""
    parts = load("profile/private_parts.py")
    loss = lambda w, x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    w, x = jnp.ones((3, 4)), jnp.ones((2, 5, 3))
    found = {}
    for name in ("ghost", "output gradients unpinned"):
        with parts.swapped(parts.VARIANTS[name]):
            step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))
            text = step.trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
        found[name] = text.count("@LayoutConstraint(")
    assert found == {"ghost": 1, "output gradients unpinned": 0}


def test_the_convolution_variant_undoes_what_it_names(monkeypatch):
    """private_parts.py's ``convolutions' sums together`` takes the convolutions' clipped sums
    without `_sums.in_turn`'s loop on a CPU."""
    from optclip.per_example.ghost import _sums

    parts = load("profile/private_parts.py")

    def conv(h, k):
        return lax.conv_general_dilated(h, k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))

    loss = lambda p, x: jnp.sum(jnp.sin(conv(jnp.tanh(conv(x, p[0])), p[1])))  # noqa: E731
    p, x = (jnp.ones((3, 2, 2)) / 4, jnp.ones((3, 2, 2)) / 4), jnp.ones((2, 5, 2))
    found, turns = {}, []
    spy = lambda items, *rest, f=_sums.in_turn: turns.append(len(items)) or f(items, *rest)  # noqa: E731
    monkeypatch.setattr(_sums, "in_turn", spy)
    for name in ("ghost", "convolutions' sums together"):
        turns.clear()
        with parts.swapped(parts.VARIANTS[name]):
            step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))
            text = step.trace(p, x).lower(lowering_platforms=("cpu",)).as_text()
        found[name] = (text.count("stablehlo.while"), len(turns))
    assert found["ghost"][0] == found["convolutions' sums together"][0] + 1, found
    assert found["ghost"][1] >= 1 and found["convolutions' sums together"][1] == 0, found


def test_matrix_products_are_counted_as_often_as_they_run():
    parts = load("profile/private_parts.py")
    w = jnp.ones((4, 5))

    def f(x):  # (2, 4) @ (4, 5): 2 * 2 * 5 * 4 = 80 a product
        y = jax.lax.scan(lambda c, _: (c, c @ w), x, length=3)[1]  # 3 times
        z = jax.lax.cond(x[0, 0] > 0, lambda: x @ w, lambda: (x @ w) @ w.T @ w)  # the cheaper
        return y, jax.jit(lambda x: x @ w)(x), jax.checkpoint(lambda x: x @ w)(x), z

    assert parts.dot_flops(jax.make_jaxpr(f)(jnp.ones((2, 4))).jaxpr) == 80 * (3 + 1 + 1 + 1)


@pytest.mark.slow
def test_the_precision_benchmark_measures_both_methods_at_both_precisions(tmp_path):
    """private_precision.py --quick: each method's error against float64 at matmul precision
    'default' and 'highest'; on a CPU both are float32 dots, so every error is float32
    rounding."""
    rows = run_private(tmp_path, "--quick", "--batch", "4", script="profile/private_precision.py")
    assert {(r["model"], r["method"], r["precision"]) for r in rows} == {
        (m, f"{lib}.clipped_grad", p)
        for m in ("transformer", "mlp")
        for lib in ("optclip", "jax_privacy")
        for p in ("default", "highest")
    }
    if jax.default_backend() == "cpu":
        assert all(r["norms"] < 1e-5 and r["clipped_sum"] < 1e-5 for r in rows), rows


def test_the_gpu_check_refuses_an_unknown_step_before_it_runs_any(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "ghost", "ghosts"],
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path / "out")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown step 'ghosts' (the steps: precision t256" in proc.stderr, proc.stderr
    assert proc.stdout == "" and not (tmp_path / "out").exists()


def refused(*args, why: str, script="profile/private_parts.py"):
    """`benchmarks/<script>`'s `main` with `args` is an argparse error (exit 2) that says
    `why` (in this process: a script's process would spend seconds importing what this one
    has)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        load(script).main(list(args))
    assert exited.value.code == 2 and why in err.getvalue(), err.getvalue()


def test_the_parts_benchmark_gives_the_engine_back():
    """`private_parts.swapped` restores the engine's functions, also when tracing fails."""
    from optclip.per_example.ghost import _norms, _sums

    parts = load("profile/private_parts.py")
    before = (_norms.norms, _sums.clipped, _norms.LOOP_WORK)
    with pytest.raises(RuntimeError, match="inside"):
        with parts.swapped({"norms": None, "clipped": None, "LOOP_WORK": 0}):
            assert _norms.norms is None and _sums.clipped is None and _norms.LOOP_WORK == 0
            raise RuntimeError("inside")
    assert (_norms.norms, _sums.clipped, _norms.LOOP_WORK) == before


@pytest.mark.usefixtures("as_users_compile")  # (a compiled program's text or memory)
def test_the_parts_benchmark_compiles_the_gpus_branches_here():
    """`private_parts.gpu_branches`: a step whose engine asks for its platform (the norms one
    example at a time on a CPU, a loop) compiled for this machine takes the GPU's branch (no
    loop); `lax.platform_dependent` comes back, also when tracing fails."""
    from optclip.per_example.ghost import _norms

    parts = load("profile/private_parts.py")
    loss = lambda w, x: jnp.sum(jnp.sin(x @ w))  # noqa: E731
    w, x = jnp.ones((3, 4)), jnp.ones((2, 5, 3))
    before = lax.platform_dependent

    def loops():
        step = jax.jit(optclip.clipped_grad(loss, l2_clip_norm=1.0))
        return step.lower(w, x).compile().as_text().count(" while(")

    with parts.swapped({"LOOP_WORK": 0}):
        with parts.gpu_branches():
            assert loops() == 0
        assert lax.platform_dependent is before
        assert loops() == (1 if jax.default_backend() == "cpu" else 0)
    assert _norms.LOOP_WORK > 0
    with pytest.raises(RuntimeError, match="inside"):
        with parts.gpu_branches():
            raise RuntimeError("inside")
    assert lax.platform_dependent is before


@pytest.mark.slow
def test_the_ghost_steps_memory_is_sized_variant_by_variant(tmp_path):
    """private_parts.py --memory: each variant's compiled peak beside the non-private step's,
    their ratio; with --gpu-branches as a GPU's engine would choose; refused beside the other
    modes."""
    asked = ("--mlp", "--memory", "--batches", "8", "--variants", "ghost", "norms batched")
    for extra in ((), ("--gpu-branches",)):
        rows = run_private(tmp_path, *asked, *extra, script="profile/private_parts.py")
        assert [(r["variant"], r["batch"]) for r in rows] == [
            ("jax.grad (non-private)", 8),
            ("ghost", 8),
            ("norms batched", 8),
        ]
        base = rows[0]["peak_bytes"]
        assert base > 0 and all(r["memory_ratio"] == r["peak_bytes"] / base for r in rows[1:])
        assert "time_s" not in rows[1]
    refused("--memory", "--grams", why="--memory sizes the steps' parts")
    refused("--memory", "--flops", why="--flops counts the steps' parts")
    refused("--kernels", "--memory", why="--kernels profiles the two steps")
    refused("--gpu-branches", "--products", why="--gpu-branches builds the ghost steps")


@pytest.mark.slow
def test_the_parts_benchmark_casts_the_model_to_the_dtype_asked(capsys):
    """private_parts.py --dtype: the model's parameters and floating-point inputs in bfloat16
    (token ids and labels as they are), the transformer's loss in bfloat16 too (its scale of
    the attention logits once promoted it to float32); the MLP's steps sized in it: the
    non-private step holds its bfloat16 parameters and gradients, less than in float32."""
    parts = load("profile/private_parts.py")
    models = load("_private_models.py")
    shape = models.TransformerShape(d=16, seq=4, vocab=11, blocks=2, heads=2)
    params = models.cast(models.transformer_params(shape), jnp.bfloat16)
    tokens = models.cast(models.transformer_batch(shape, 3), jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert tokens.dtype == jnp.int32
    loss = functools.partial(models.transformer_loss, heads=2)
    assert jax.eval_shape(loss, params, tokens).dtype == jnp.bfloat16
    x, labels = models.cast(models.mlp_batch(models.MLPShape(), 4), jnp.float16)
    assert (x.dtype, labels.dtype) == (jnp.float16, jnp.int32)
    asked = ["--mlp", "--memory", "--batches", "8", "--variants", "ghost"]
    peaks = {}
    for dtype in ("float32", "bfloat16"):
        rows = parts.main([*asked, "--dtype", dtype])
        assert [(r["variant"], r["batch"]) for r in rows] == [
            ("jax.grad (non-private)", 8),
            ("ghost", 8),
        ]
        assert f"cpu, {dtype}" in capsys.readouterr().out or jax.default_backend() != "cpu"
        peaks[dtype] = rows[0]["peak_bytes"]
    assert peaks["bfloat16"] < peaks["float32"]
    refused("--dtype", "bfloat16", "--grams", why="--dtype casts the benchmark's model")
    refused("--dtype", "float16", "--products", why="--dtype casts the benchmark's model")
    refused("--dtype", "float64", why="invalid choice: 'float64'")


COUNT, GIB = "must be a whole number of at least 1", "must be a number of GiB above 0"


@pytest.mark.parametrize(
    "script, args, named, given, rule",
    [
        ("private.py", ["--batches", "16", "0"], "--batches", "'0'", COUNT),
        ("profile/private_frozen.py", ["--batches", "-4"], "--batches", "'-4'", COUNT),
        ("profile/private_parts.py", ["--pairs", "-1"], "--pairs", "'-1'", COUNT),
        ("profile/private_precision.py", ["--batch", "0"], "--batch", "'0'", COUNT),
        ("run.py", ["--compile-pairs", "0"], "--compile-pairs", "'0'", COUNT),
        ("versions.py", ["HEAD", "--pairs", "2.5"], "--pairs", "'2.5'", COUNT),
        ("private.py", ["--budget-gib", "0"], "--budget-gib", "'0'", GIB),
        ("private.py", ["--run-limit-gib", "-1"], "--run-limit-gib", "'-1'", GIB),
        ("profile/private_frozen.py", ["--budget-gib", "nan"], "--budget-gib", "'nan'", GIB),
        ("profile/private_frozen.py", ["--budget-gib", "lots"], "--budget-gib", "'lots'", GIB),
    ],
)
def test_the_scripts_refuse_a_count_or_a_memory_limit_out_of_range(
    script, args, named, given, rule
):
    # `--pairs 0` used to mean the default (`args.pairs or 5`), `--batches 0` to fail deep
    # inside a step, `--budget-gib 0` to size jax_privacy's microbatches at nothing and fail
    # the same way: each is an argparse error naming the argument, before anything runs.
    refused(*args, why=f"argument {named}: {rule}, got {given}", script=script)


def test_each_contender_is_timed_over_the_sample_time(monkeypatch):
    # `private.py` times the MLP's steps of milliseconds beside jax_privacy's of seconds: with
    # one number of calls per round for all (set by the slowest), the fast ones were timed one
    # call at a time, mostly noise. With `each`, every contender gets its own. (On a clock of
    # the test's own, which each step advances: real sleeps on a loaded machine last longer
    # than asked, and the counts came out other than 0.02 / 0.0005.)
    import types

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _timing

    now = [0.0]
    monkeypatch.setattr(_timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    for each in (False, True):
        calls = [0, 0]

        def step(k, seconds, calls=calls):
            calls[k] += 1
            now[0] += seconds

        slow, fast = (lambda: step(0, 0.02)), (lambda: step(1, 0.0005))
        paired = _timing.interleaved([slow, fast], pairs=3, warmup=0, min_sample_s=0.02, each=each)
        assert len(paired.times[0]) == len(paired.times[1]) == 3
        # (one call each to calibrate, then 3 rounds of 1 call, or of 40 for the fast one)
        assert calls == ([4, 121] if each else [4, 4]), calls
        assert paired.medians == pytest.approx((0.02, 0.0005)), paired.medians


@pytest.mark.slow
def test_the_compile_benchmark_measures_every_method_on_each_model(tmp_path):
    """benchmarks/compile.py --quick: each method's trace+lower and compile times of a fresh
    step, its program's lines and conditionals, on both quick models; the non-private step is
    the reference of the ratios; `--markdown`'s table names every row."""
    rows = run_private(tmp_path, "--quick", script="compile.py")
    methods = ["jax.grad (non-private)", "optclip.clipped_grad", "jax_privacy.clipped_grad"]
    for model in ("unrolled-2", "mlp-4"):
        got = {r["method"]: r for r in rows if r["model"] == model}
        assert sorted(got) == sorted(methods), got
        for r in got.values():
            assert r["trace_lower_s"] > 0 and r["compile_s"] > 0 and r["total_s"] > 0, r
            assert r["lines"] > 0 and r["conditionals"] >= 0 and r["total_ratio"] > 0, r
            assert r["jax"] == jax.__version__ and r["device"] and r["date"], r
        plain = got["jax.grad (non-private)"]
        assert plain["total_ratio"] == 1.0 and plain["lines_ratio"] == 1.0, plain
    assert len(rows) == 6, rows
    table = load("compile.py").markdown(rows)
    for r in rows:
        assert f"| {r['model']} | {r['method']} |" in table, table


@pytest.mark.slow
def test_the_compile_phases_are_read_from_xlas_log(tmp_path):
    """benchmarks/profile/compile_phases.py: the non-private and the ghost step's compile split
    into XLA's HLO passes, the kernels' emission and LLVM, each phase within the compile's
    wall time; a count out of range is refused."""
    rows = run_private(
        tmp_path, "--only", "mlp-4", "--repeats", "1", script="profile/compile_phases.py"
    )
    assert [r["method"] for r in rows] == ["jax.grad (non-private)", "optclip.clipped_grad"]
    for r in rows:
        phases = (r["passes_s"], r["emit_s"], r["llvm_s"])
        assert all(0 < s < r["compile_s"] for s in phases), r
        assert sum(phases) <= r["compile_s"] * 1.05, r
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "profile" / "compile_phases.py"),
            "--passes",
            "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "must be a whole number of at least 1" in proc.stderr, proc


@pytest.mark.slow
def test_the_ghost_steps_compile_is_measured_part_by_part(tmp_path):
    """benchmarks/profile/compile_parts.py: every program of the ghost step's parts, written
    out with the engine's functions, computes the norms and clipped sums it names (against the
    script's float64 reference, the engine's own step too), and is compiled beside the
    non-private step; a part with a wrong sum is caught by that comparison."""
    rows = run_private(
        tmp_path, "--only", "mlp-4", "--repeats", "1", script="profile/compile_parts.py"
    )
    parts = load("profile/compile_parts.py")
    assert [r["variant"] for r in rows] == list(parts.VARIANTS), rows
    for r in rows:
        assert r["error"] < 1e-5, r
        assert 0 < r["distinct"] <= r["fusions"] and r["compile_s"] > 0, r
    by = {r["variant"]: r for r in rows}
    assert by["jax.grad (non-private)"]["total_ratio"] == 1.0
    assert by[parts.SPLIT]["fusions"] > by[parts.STACKED]["fusions"], rows
    # a sum without its bias term is an error the comparison reports
    _, setup = parts.MODELS["mlp-4"]
    _, params, batch = setup()
    want = parts.reference(params, batch)
    norms, sums = jax.jit(parts.part(parts.SUMS))(params, batch)
    assert parts.error(parts.SUMS, (norms, sums), want) < 1e-5
    sums[1] = (sums[1][0], 0 * sums[1][1])
    assert parts.error(parts.SUMS, (norms, sums), want) == 1.0


def test_the_design_page_shows_the_recurrent_runs_in_both_scheduler_orders_side_by_side():
    """ghost-costs.md's table of XLA's CPU scheduler is the two saved runs' (`recurrent.py
    --markdown ... --beside ...`): the default order's, which kept no XLA flags, and the
    memory order's, which kept the flag it ran under; the page's and the speed guide's "at most
    1.39x" is the largest private memory ratio of the second."""
    bench = load("recurrent.py")
    results = ROOT / "benchmarks" / "results"
    default, memory = (
        results / f"recurrent_seqs_{n}_cpu.json" for n in ("default", "memory_order")
    )
    assert bench.flags(default) == "default"
    assert bench.flags(memory) == "`--xla_cpu_enable_concurrency_optimized_scheduler=false`"
    table = bench.beside(
        bench.load_rows(default),
        bench.load_rows(memory),
        (bench.flags(default), bench.flags(memory)),
    )
    page = (ROOT / "docs" / "design" / "ghost-costs.md").read_text(encoding="utf-8")
    guide = (ROOT / "docs" / "guides" / "speed.md").read_text(encoding="utf-8")
    assert table in page
    ghost = [
        {(r["model"], r["batch"]): r for r in bench.load_rows(path) if r["method"] == bench.GHOST}
        for path in (default, memory)
    ]
    most = f"at most {max(r['peak_ratio'] for r in ghost[1].values()):.2f}x"
    moved = max(abs(ghost[1][k]["time_ratio"] - r["time_ratio"]) for k, r in ghost[0].items())
    assert most in page and most in guide, most
    assert f"by up to {moved:.2f}x" in page and f"by up to {moved:.2f}x" in guide, moved
    # (the guide's default-order figures: Equinox's GRU's and dm-haiku's largest at 64 steps)
    gru, deep = (
        max(ghost[0][f"{m} T=64", b]["peak_ratio"] for b in (32, 256))
        for m in ("eqx-gru", "hk-deeprnn")
    )
    assert f"up to {gru:.2f}x" in guide and f"`DeepRNN` {deep:.2f}x" in guide, (gru, deep)


def test_two_runs_side_by_side_must_be_of_the_same_models_and_batches():
    bench = load("recurrent.py")
    rows = bench.load_rows(ROOT / "benchmarks" / "results" / "recurrent_seqs_default_cpu.json")
    with pytest.raises(ValueError, match=r"only in the first \['hk-deeprnn T=64, 256'\]"):
        bench.beside(rows, rows[:-2], ("a", "b"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--beside", "x.json"], "--beside prints beside a --markdown file"),
        (["--markdown", "missing.json"], "--markdown: no saved run at missing.json"),
        (
            ["--markdown", "benchmarks/results/recurrent_seqs_default_cpu.json", "--beside", "m"],
            "--beside: no saved run at m",
        ),
    ],
)
def test_the_recurrent_tables_options_are_checked(args, message, capsys):
    with contextlib.chdir(ROOT), pytest.raises(SystemExit) as stop:
        load("recurrent.py").main(args)
    assert stop.value.code == 2 and message in capsys.readouterr().err


# One private step of Equinox's GRU at 64 steps, batch 32: its compiled peak, as compiled and
# with the scheduler's flag as a per-compile option (printed as JSON).
_SCHEDULER_PROBE = """
import json, sys
sys.path.insert(0, "benchmarks")
import jax
import recurrent
from private import GHOST, contenders, peak_bytes
loss, params, batch_of = recurrent.setups(recurrent.Shape(seq=64))["eqx-gru"]
lowered = jax.jit(contenders(loss, 32, 0, float("inf"))[GHOST][0]).lower(params, batch_of(32))
options = {"xla_cpu_enable_concurrency_optimized_scheduler": False}
as_option = lowered.compile(compiler_options=options)
print(json.dumps([peak_bytes(lowered.compile()), peak_bytes(as_option)]))
"""


@pytest.mark.slow
def test_the_scheduler_flag_the_speed_guide_names_lowers_a_recurrent_steps_memory():
    """The speed guide: `XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false`
    lowers the private step's memory of a recurrent model on a CPU, and the same flag as a
    `compiler_options` entry changes nothing (so the guide names the environment variable).
    When a jax release changes either, this test says the guide is out of date."""
    flag = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    peaks = []
    for flags in (os.environ.get("XLA_FLAGS", ""), f"{os.environ.get('XLA_FLAGS', '')} {flag}"):
        env = {**os.environ, "XLA_FLAGS": flags.strip()}
        proc = subprocess.run(
            [sys.executable, "-c", _SCHEDULER_PROBE],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        peaks.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    (default, as_option), (flagged, _) = peaks
    assert as_option == default, peaks
    assert flagged < default, peaks


def test_a_saved_run_keeps_the_xla_flags_it_ran_under(tmp_path, monkeypatch):
    private = load("private.py")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    private.save_run(tmp_path / "with.json", [], "a machine")
    monkeypatch.delenv("XLA_FLAGS")
    private.save_run(tmp_path / "without.json", [], "a machine")
    kept = json.loads((tmp_path / "with.json").read_text())
    assert kept["xla_flags"] == "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    assert "xla_flags" not in json.loads((tmp_path / "without.json").read_text())


def test_the_guide_and_the_design_pages_show_the_saved_compile_run():
    """The speed guide's compile-time table is the saved run's
    (`benchmarks/results/compile_cpu.json`), as `compile.py --markdown` prints it; the design
    page on the ghost engine's compile holds the same table (its rows, under its own heading)."""
    bench = load("compile.py")
    rows = bench.load_rows(ROOT / "benchmarks" / "results" / "compile_cpu.json")
    table = bench.markdown(rows)
    assert table in (ROOT / "docs" / "guides" / "speed.md").read_text(encoding="utf-8")
    rows_only = "\n".join(line for line in table.splitlines() if line.startswith("|"))
    compile_page = (ROOT / "docs" / "design" / "ghost-compile.md").read_text(encoding="utf-8")
    assert rows_only in compile_page


def test_a_run_names_the_cpu_it_ran_on(tmp_path):
    """`_timing.cpu_model`, which `private.py`, `recurrent.py`, `compile.py` and `run.py`
    record in their runs: the model Linux names, else `platform`'s answer."""
    timing = load("_timing.py")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: Example\nmodel name\t: Example CPU 9000\n")
    assert timing.cpu_model(info) == "Example CPU 9000"
    fallback = platform.processor() or platform.machine() or "unknown"
    assert timing.cpu_model(tmp_path / "missing") == fallback
    info.write_text("processor\t: 0\n")
    assert timing.cpu_model(info) == fallback
