#!/usr/bin/env bash
# The GPU checks in one call, for a machine with one CUDA GPU and torch + Triton already installed
# (no network): the GPU tests, the example trained on one rank, then the bench suites that run on
# one GPU (kernel, offload, overhead at 1 rank; step, memory and muon need one GPU per rank, 2 or more), and
# python -m bench.host_phases --profile-step (host time per phase; opt.step() under cProfile).
# Logs and CSVs go to $OUT (default ./gpu-out). Run from the repository root:
#     bash bench/on_gpu.sh
# BENCH_SUITES="kernel" picks suites ("none": no bench), SKIP_EXAMPLE=1 skips the example, BENCH_ARGS=--quick shrinks them.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $(date -u +%T) $*"; }

log "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >"$OUT/install.txt" 2>&1 || { cat "$OUT/install.txt"; exit 1; }

log "GPU tests (kernels on CUDA, CPU offload on CUDA) and the torch-internals checks"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/offload/test_offload_gpu.py tests/test_compat.py \
    tests/step/test_device_decision.py tests/test_memory_estimate.py 2>&1 | tee "$OUT/tests.txt" | tail -25

if [ -z "${SKIP_EXAMPLE:-}" ]; then
    log "the example on one GPU rank, bf16, 300 steps"
    timeout 180 python3 -m torch.distributed.run --nproc_per_node 1 examples/train_gpt.py --steps 300 --dtype bfloat16 \
        --log-interval 100 2>&1 | tee "$OUT/example.txt" | tail -8
fi

suites=${BENCH_SUITES:-kernel offload overhead}
if [ "$suites" != none ]; then
    log "bench $suites"
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-360}" python3 -m bench $suites ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.txt"
fi
if [ "$suites" != none ]; then
    log "host time per phase, and opt.step() under cProfile"
    timeout 240 python3 -m bench.host_phases --profile-step 2>&1 | tee "$OUT/host_phases.txt" | grep "ms/step"
fi
log "done"
