#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (the `device` tool's H100 or H200, 16 cores): build the
# CUDA ops and run the `gpu` kernel tests, then the GPU checks in their order of value, each with its
# own time limit and its own JSON in $OUT, and last the summary $OUT/gpu_checks.json
# (benchmarks/gpu_summary.py). Within BUDGET_S (9 minutes) by its limits: a step whose limit would
# pass the budget is skipped, and says so in its JSON.
#
#   planner_1b.json         bench_planner.py --gpu: the `1b` preset planned under a GPU budget well
#                           below its training state against DeepSpeed's ZeRO-Infinity offload under
#                           the same budget (speedup, prediction errors, TFLOPS, model-FLOPs fraction)
#   packing_1b.json         bench_activations.py on the `1b` preset (step time, bytes, gradient error)
#   checkpoint_stall.json   bench_checkpoint.py --gpu: the lazy checkpoint's stall against DeepSpeed's
#                           default engine on one GPU
#   optimizer.json          bench_optim.py --gpu-only: the 8-bit step against torch's fused AdamW and
#                           bitsandbytes' AdamW8bit where it imports, and its bandwidth fraction
#   int8_exchange_nccl.json the int8 exchange on NCCL: needs more than one GPU (skipped, saying why)
#   logs.tar.gz             every step's log, nvidia-smi, the build and the kernel tests
# ($OUT gives back at most 8 files: hence one archive of the logs.)
#
# That machine's image has torch, pytest, numpy, ninja, xxhash and matplotlib, but not deepspeed,
# pydantic or mip. The kernel tests (tests/ops) need none of those; the rest need them carried as
# wheels in .whl/ (built here with `pip wheel --no-deps -w .whl deepspeed==0.19.8 hjson` and, for
# Python 3.12 manylinux, `pip download --no-deps --only-binary=:all:` of pydantic, pydantic-core,
# annotated-types, typing-inspection, mip, cffi and pycparser, and mip's solver wheel, which the
# planner's step solves with; see the device tool's README). A step stopped at its limit gets SIGABRT,
# on which Python (-X faulthandler) prints where every thread was.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
#     GPU_CHECKS_DRY_RUN=1 OUT=/tmp/gpu bash benchmarks/gpu_checks.sh   # no GPU: build every command,
#                                       check its script's flags and its inputs, time nothing (tests/test_gpu_checks.py)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lazyzero_gpu_checks}
DRY_RUN=${GPU_CHECKS_DRY_RUN:-0}
BUDGET_S=${GPU_CHECKS_BUDGET_S:-540}
LOGS=$OUT/logs
mkdir -p "$LOGS"
: >"$LOGS/steps.tsv"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
started=$(date +%s)
status=0

skip_json() {  # skip_json NAME REASON: the step's JSON says why it did not run
    python3 -c 'import json, sys; print(json.dumps({"step": sys.argv[1], "skipped": sys.argv[2]}))' "$1" "$2" \
        >"$OUT/$1.json"
    printf '%s\tskipped\t0\t0\t%s\n' "$1" "$2" >>"$LOGS/steps.tsv"
    echo "[gpu_checks] $1: skipped: $2"
}

dry_check() {  # dry_check NAME COMMAND...: the script's --help names every flag the command gives it
    local name=$1 script="" help
    shift
    for word in "$@"; do
        case $word in *.py) script=$word; break ;; esac
    done
    if [ -z "$script" ]; then
        return 0
    fi
    [ -f "$script" ] || { echo "[gpu_checks] $name: no $script" >&2; return 1; }
    help=$(python3 "$script" --help 2>&1) || { echo "[gpu_checks] $name: $script --help failed:" >&2; echo "$help" >&2; return 1; }
    for word in "$@"; do
        case $word in --*) grep -q -- "${word%%=*}" <<<"$help" || {
            echo "[gpu_checks] $name: $script has no $word" >&2; return 1; } ;;
        esac
    done
}

step() {  # step NAME LIMIT_S COMMAND...: run it under its limit, its log in $LOGS; a dry run checks it
    local name=$1 limit=$2 elapsed rc began
    shift 2
    elapsed=$(( $(date +%s) - started ))
    echo "[gpu_checks] $name (limit ${limit} s, ${elapsed} s gone): $*"
    if [ "$DRY_RUN" = 1 ]; then
        dry_check "$name" "$@" || status=1
        return
    fi
    if (( elapsed + limit > BUDGET_S )); then
        skip_json "$name" "not started: ${elapsed} s gone and its ${limit} s limit would pass the script's ${BUDGET_S} s"
        return
    fi
    began=$(date +%s)
    timeout -s ABRT "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\t\n' "$name" "$rc" "$(( $(date +%s) - began ))" "$limit" >>"$LOGS/steps.tsv"
    tail -n 5 "$LOGS/$name.log"
    [ "$rc" = 0 ] || status=1
}

if [ "$DRY_RUN" = 1 ]; then
    echo "[gpu_checks] dry run: commands built and checked, nothing timed"
    python3 -c 'import sys; from lazyzero.cli import main; sys.exit(main())' config check --world-size 1 \
        ds_configs/gpu_1b_planned_80gb.json >"$LOGS/config_check.log" 2>&1 \
        || { echo "[gpu_checks] ds_configs/gpu_1b_planned_80gb.json is invalid:" >&2; cat "$LOGS/config_check.log" >&2; status=1; }
    python3 -m pytest -q --collect-only -m gpu tests/ops >"$LOGS/collect.log" 2>&1 \
        || { echo "[gpu_checks] the gpu kernel tests do not collect:" >&2; tail -n 20 "$LOGS/collect.log" >&2; status=1; }
else
    if compgen -G ".whl/*.whl" >/dev/null; then
        timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
            export PYTHONPATH=$PYTHONPATH:/tmp/site
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
fi
gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU')
have_deepspeed=1
[ "$DRY_RUN" = 1 ] || python3 -c "import deepspeed, pydantic, mip" 2>/dev/null || have_deepspeed=0
NO_DEEPSPEED="deepspeed, pydantic or mip not importable: carry their wheels in .whl/"
PY="python3 -X faulthandler"

# Build and kernel tests first, short: every later step runs these kernels.
step build 75 python3 -c "from lazyzero.ops import native_build as b; print(b.format_status(b.build(verbose=False)))"
step kernel_tests 60 $PY -m pytest -q -m gpu tests/ops

if [ "$have_deepspeed" = 1 ]; then
    step planner_1b 210 $PY benchmarks/bench_planner.py --gpu --work /tmp/lazyzero_bench_planner \
        --out "$OUT/planner_1b.json"
else
    skip_json planner_1b "$NO_DEEPSPEED"
fi
step packing_1b 45 $PY benchmarks/bench_activations.py --quick --preset 1b --seq 2048 --batch 1 \
    --out "$OUT/packing_1b.json"
if [ "$have_deepspeed" = 1 ]; then
    step checkpoint_stall 90 $PY benchmarks/bench_checkpoint.py --gpu --quick --pairs 2 \
        --out "$OUT/checkpoint_stall.json"
else
    skip_json checkpoint_stall "$NO_DEEPSPEED"
fi
step optimizer 30 $PY benchmarks/bench_optim.py --gpu-only --quick --out "$OUT/optimizer.json"
if [ "$gpus" -gt 1 ]; then
    # bench_grad_comm.py times the exchange on gloo CPU ranks; its NCCL mode is not written yet.
    skip_json int8_exchange_nccl "$gpus GPUs, but bench_grad_comm.py has no NCCL mode yet (gloo CPU ranks only)"
else
    skip_json int8_exchange_nccl "needs more than one GPU; this machine has ${gpus}"
fi

if [ "$DRY_RUN" = 1 ]; then
    dry_check summary python3 benchmarks/gpu_summary.py --out-dir "$OUT" --steps "$LOGS/steps.tsv" || status=1
else
    timeout 10 python3 benchmarks/gpu_summary.py --out-dir "$OUT" --steps "$LOGS/steps.tsv" \
        --gpu "$(head -n 2 "$LOGS/gpu.txt" | tail -n 1)" || status=1
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"
fi
echo "[gpu_checks] done in $(( $(date +%s) - started )) s, status $status"
exit $status
