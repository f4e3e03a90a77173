#!/usr/bin/env bash
# A GPU check anyone can run in minutes (docs/gpu.md): under 8 minutes on one GPU.
#
#   bench/gpu_check.sh            # from the repository root, with .venv (make setup) or python on PATH
#
# 1. the CUDA tests (every test whose name says cuda), which CPU-only machines skip;
# 2. a federation of a CPU coordinator, a CPU site and a CUDA site over loopback gRPC, for every
#    strategy (bench/bench_kernels.py --cuda-site --check): no full-state resend, repairs under
#    1% of the bytes, and the final metric beside the same run with both sites on the CPU;
# 3. bf16 autocast on the GPU, every built-in workload (bench/bench_precision.py --check): no layer
#    dense for its dtype, dAD's and auto's updates within bf16's tolerance of autograd's;
# 4. the ~100M-parameter setting on the GPU, two site processes (bench/bench_large.py): step
#    time, first step over a steady one, and bytes per step of rank-dAD against dSGD.
# Prints one line per part and a summary; exits 0 when every part passed, 1 when one failed,
# 3 when torch sees no CUDA device (nothing is checked then).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
STEPS=${GPU_CHECK_STEPS:-20}

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; then
    echo "gpu_check: torch sees no CUDA device; nothing checked"
    exit 3
fi
"$PYTHON" -c 'import torch; print("gpu_check:", torch.__version__, torch.cuda.get_device_name(0))'

results=()
part() {  # part NAME SECONDS COMMAND...: run COMMAND under a time limit, record PASS/FAIL
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    echo "== $name"
    if timeout "$limit" "$@"; then
        results+=("PASS $name ($((SECONDS - started)) s)")
    else
        results+=("FAIL $name (exit $?, $((SECONDS - started)) s)")
    fi
}

part "CUDA tests" 90 "$PYTHON" -m pytest -q -k cuda tests/
part "CUDA site beside a CPU site and a CPU coordinator, every strategy, $STEPS steps" 300 \
    "$PYTHON" -m bench.bench_kernels --cuda-site --check --sites 2 --steps "$STEPS"
part "bf16 autocast on the GPU, every built-in workload" 60 \
    "$PYTHON" bench/bench_precision.py --precision bf16 --device cuda --check
part "the 100M setting on the GPU, dSGD and rank-dAD, 4 steps" 120 \
    "$PYTHON" -m bench.bench_large --device cuda --steps 4 --out /tmp/gpu_check_large.json

echo "== summary"
printf '%s\n' "${results[@]}"
! printf '%s\n' "${results[@]}" | grep -q '^FAIL'
