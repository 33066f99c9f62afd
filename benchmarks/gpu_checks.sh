#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (the `device` tool's H200): build the CUDA ops, run
# every `gpu` test, then the GPU parts of the benchmarks. Logs and result files go to $OUT.
#
# That machine's image has torch, pytest, numpy, ninja, xxhash and matplotlib, but not deepspeed,
# pydantic or mip. The kernel tests (tests/ops) need none of those. The tests and
# benchmarks that build a DeepSpeed engine need them carried as wheels in .whl/ (built here with
# `pip wheel --no-deps -w .whl deepspeed==0.19.8 hjson` and, for Python 3.12 manylinux, `pip download
# --no-deps --only-binary=:all:` of pydantic, pydantic-core, annotated-types, typing-inspection, mip,
# cffi and pycparser; see the device tool's README). mip's solver wheel (cbcbox, 180 MB) stays behind:
# `import mip` does not load it and nothing here solves. The engine tests and benchmarks are skipped,
# with a line saying so, when deepspeed cannot be imported. Each step has its own time limit, so one
# that hangs does not take the others' time; it is stopped with SIGABRT, on which Python (-X faulthandler)
# prints where every thread was.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lazyzero_gpu_checks}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
python3 -c "from lazyzero.ops import native_build as b; print(b.format_status(b.build(verbose=False)))" \
    2>&1 | tee "$OUT/build.log"
echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"

status=0
timeout -s ABRT 120 python3 -X faulthandler -m pytest -q -m gpu tests/ops 2>&1 | tee "$OUT/gpu_kernel_tests.log" || status=1

if python3 -c "import deepspeed, pydantic" 2>/dev/null; then
    timeout -s ABRT 120 python3 -X faulthandler -m pytest -q -m gpu tests/gradients/test_quantized_collectives_cuda.py tests/checkpoint/test_lazy_engine.py \
        tests/activations/test_packing_cuda.py 2>&1 \
        | tee "$OUT/gpu_engine_tests.log" || status=1
    timeout -s ABRT 150 python3 -X faulthandler benchmarks/bench_activations.py --quick --out "$OUT/bench_activations.json" 2>&1 \
        | tee "$OUT/bench_activations.log" || status=1
    timeout -s ABRT 150 python3 -X faulthandler benchmarks/profile_activations.py 2>&1 | tee "$OUT/profile_activations.log" || status=1
    timeout -s ABRT 90 python3 -X faulthandler benchmarks/bench_quant.py --quick --out "$OUT/bench_quant.json" 2>&1 | tee "$OUT/bench_quant.log" || status=1
    # Last: its one-rank ZeRO-2 engine on NCCL outlasted 100 s on the H200 once (docs/optimizer.md).
    timeout -s ABRT 150 python3 -X faulthandler benchmarks/bench_optim.py --quick --out "$OUT/bench_optim.json" 2>&1 | tee "$OUT/bench_optim.log" || status=1
else
    echo "deepspeed or pydantic not importable: engine tests and benchmarks skipped (carry their wheels in .whl/)" \
        | tee "$OUT/skipped.txt"
fi
exit $status
