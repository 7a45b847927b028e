#!/usr/bin/env bash
# Ghost clipping on a GPU, in one short run (a lent machine's minutes are few). Steps, in the
# order given (default: all, in this order):
#   precision  the default matmul precision's error (benchmarks/profile/private_precision.py);
#   t256 t64 t16  benchmarks/private.py's transformer at that batch, one JSON each; --budget-gib
#              64: jax_privacy without microbatches where its per-example gradients fit;
#   mlp        benchmarks/private.py's MLP;
#   ghost      the ghost tests, every case, at matmul precision 'highest' (the default is TF32
#              on such a GPU, and the tests compare with float64 at float32's tolerances);
#   fast       the fast tier (the installed JAX may be newer than any on the package index);
#   known      the tests that failed on an H200 with jax 0.11.2 (docs/design/limits.md),
#              with their tracebacks (the fast tier's were cut off by its time limit);
#   parts      benchmarks/profile/private_parts.py at 256: the ghost step with each part taken
#              out, and with its Grams at HIGHEST (float32) beside the step's TF32 ones;
#   mlpparts   the same on the MLP at 16 and 256, whose steps of a tenth of a millisecond
#              count kernels and the `cond`s' branch decisions, after each part's compiled
#              peak memory at 16, 64 and 256 (--memory; the ghost step's in bfloat16 too);
#   kernels    private_parts.py --kernels: both steps' device time by source line, the
#              transformer and the MLP at 256, with XLA's command buffers off (with them, a
#              profile shows each CUDA graph as one event: no instruction is named).
# Each step has its own time limit, and a step that fails leaves the next to run.
#     OUT=/some/dir bash benchmarks/gpu_check.sh [step ...]
# jax_privacy and its needs travel as wheels in .whl/ where the machine has none.
set -u
STEPS="precision t256 t64 t16 mlp ghost fast known parts mlpparts kernels"
steps=${*:-precision t256 t64 t16 mlp ghost fast}
for s in $steps; do  # every step known before anything runs
    case " $STEPS " in
        *" $s "*) ;;
        *) echo "gpu_check.sh: unknown step '$s' (the steps: $STEPS)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
limited() { echo "== $* (limit $1 s)"; timeout "$@"; echo "== exit $?"; }
bench() { limited "$1" python3 benchmarks/private.py --budget-gib 64 --run-limit-gib 100 "${@:2}"; }
parts() { limited "$1" python3 benchmarks/profile/private_parts.py "${@:2}"; }
tests() {
    XLA_PYTHON_CLIENT_PREALLOCATE=false limited "$1" python3 -m pytest -p no:cacheprovider \
        -n 12 -v "${@:3}" >"$OUT/$2.log" 2>&1
    grep -E "FAILED|ERROR" "$OUT/$2.log" | sort | head -30
    grep -cE "PASSED" "$OUT/$2.log"
    tail -1 "$OUT/$2.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import jax, optax, jax_privacy, flax; print('jax', jax.__version__, 'optax', \
optax.__version__, 'flax', flax.__version__, jax.devices())"
for s in $steps; do
    case $s in
        precision) limited 80 python3 benchmarks/profile/private_precision.py --batch 16 ;;
        t256 | t64 | t16)
            bench "$([ "$s" = t256 ] && echo 110 || echo 60)" --only transformer \
                --batches "${s#t}" --json "$OUT/transformer_${s#t}.json" ;;
        mlp) bench 70 --only mlp --json "$OUT/mlp.json" ;;
        ghost)
            JAX_DEFAULT_MATMUL_PRECISION=highest tests 100 ghost -m "slow or not slow" \
                -k "not eight_devices" tests/test_ghost.py tests/test_ghost_jax_privacy.py \
                tests/test_ghost_flax.py ;;
        fast) tests 80 fast ;;
        known)
            tests 90 known --tb=short -rf -m "slow or not slow" src/optclip/clips/_functional.py \
                src/optclip/norms/_axes.py src/optclip/_errors.py tests/test_doc_blocks.py \
                tests/test_ghost.py -k "global_norm or check_split or reraise_errors or \
                README or large_runs or logging or choosing-a-clip or multi-device or migrating or \
                nonfinite or per-example or padding_ex"
            tail -60 "$OUT/known.log" ;;
        parts) parts 200 --batches 256 --pairs 5 --json "$OUT/parts.json" ;;
        mlpparts)
            parts 40 --mlp --memory --batches 16 64 256 --json "$OUT/mlp_memory.json"
            parts 40 --mlp --memory --batches 16 64 256 --dtype bfloat16 --variants ghost \
                --json "$OUT/mlp_memory_bf16.json"
            parts 120 --mlp --batches 16 256 --pairs 20 --json "$OUT/mlp_parts.json" ;;
        kernels)
            off="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
            XLA_FLAGS=$off parts 90 --kernels --batches 256 --top 45 --json "$OUT/kernels.json"
            XLA_FLAGS=$off parts 60 --kernels --mlp --batches 256 --top 25 \
                --json "$OUT/mlp_kernels.json" ;;
    esac
done
for f in "$OUT"/transformer_*.json "$OUT"/mlp.json; do
    [ -e "$f" ] && python3 benchmarks/private.py --markdown "$f"
done
