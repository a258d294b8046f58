#!/usr/bin/env bash
# GPU check in one command: build with CUDA, run the GPU tests and compute-sanitizer's racecheck, synccheck, memcheck
# and initcheck over small cases of every kernel (bench/gpu/sanitize.py), benchmark every CUDA kernel, run the demo on
# GPU ranks (NCCL), append all of it to bench/RESULTS.md, then run the rest of the test suite. Exits 2 (and says so) where no
# GPU is found, and non-zero when any test failed (the benchmark and demo still run, so one try records everything).
#
# A GPU machine's image often brings torch and has no network: when `python3` (or $PYTHON) already imports torch
# with a GPU, pytest and hypothesis, the extension is built against it and nothing is installed. Otherwise
# scripts/setup.sh makes .venv as on a CPU machine. Logs go to $DCP_GPU_LOGS (default /tmp). DCP_GPU_SKIP_REST=1 skips
# the CPU part of the suite at the end (CI runs it; a short GPU lease may not want to).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu/run.sh: no GPU found (nvidia-smi lists none); nothing was run." >&2
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
logs=${DCP_GPU_LOGS:-/tmp}
mkdir -p "$logs"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$cap}" DCP_OPS_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
PY=${PYTHON:-python3}
if "$PY" -c "import torch, pytest, hypothesis; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "bench/gpu/run.sh: building against $(command -v "$PY")"
  "$PY" setup.py -q build_ext --inplace
else
  bash scripts/setup.sh
  PY=.venv/bin/python
fi
torch_version=$("$PY" -c 'import torch; print(torch.__version__)')

status=0
"$PY" -m pytest -q tests/test_cuda.py 2>&1 | tee "$logs/dcp_gpu_tests.log" || status=1
# compute-sanitizer over small cases of every kernel (bench/gpu/sanitize.py), each tool at most 60 s
sanitizer=$(command -v compute-sanitizer || ls "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" 2>/dev/null || true)
: > "$logs/dcp_gpu_sanitizer.log"
if [ -n "$sanitizer" ]; then
  for tool in racecheck synccheck memcheck initcheck; do
    if timeout 60 "$sanitizer" --tool "$tool" --error-exitcode 1 "$PY" bench/gpu/sanitize.py \
        > "$logs/dcp_gpu_sanitizer_$tool.log" 2>&1; then
      echo "compute-sanitizer $tool: clean" | tee -a "$logs/dcp_gpu_sanitizer.log"
    else
      echo "compute-sanitizer $tool: FAILED (rc $?; last lines below)" | tee -a "$logs/dcp_gpu_sanitizer.log"
      tail -15 "$logs/dcp_gpu_sanitizer_$tool.log" | tee -a "$logs/dcp_gpu_sanitizer.log"
      status=1
    fi
  done
else
  echo "compute-sanitizer: not found on this machine; not run" | tee "$logs/dcp_gpu_sanitizer.log"
fi
"$PY" bench/gpu/bench_cuda.py --json "$logs/dcp_gpu_bench.json" 2>&1 | tee "$logs/dcp_gpu_bench.txt" || status=1
"$PY" -m dcp_ops demo --device cuda --dtype bfloat16 2>&1 | tee "$logs/dcp_gpu_demo.txt" || status=1
{
  echo
  echo "## GPU — $(date -u +%Y-%m-%d), $gpu (sm_${cap/./}), torch $torch_version, \`bash bench/gpu/run.sh\`"
  echo
  echo "GPU tests (tests/test_cuda.py): $(tail -1 "$logs/dcp_gpu_tests.log")"
  echo
  echo '```'
  cat "$logs/dcp_gpu_sanitizer.log"
  echo '```'
  echo
  echo '```'
  cat "$logs/dcp_gpu_bench.txt"
  echo '```'
  echo
  echo '`python -m dcp_ops demo --device cuda --dtype bfloat16`:'
  echo
  echo '```'
  cat "$logs/dcp_gpu_demo.txt"
  echo '```'
} >> bench/RESULTS.md
cp bench/RESULTS.md "$logs/RESULTS.md"
echo "appended to bench/RESULTS.md (copy in $logs/RESULTS.md)"
if [ "${DCP_GPU_SKIP_REST:-0}" = 1 ]; then
  echo "bench/gpu/run.sh: DCP_GPU_SKIP_REST=1: the rest of the suite was not run here"
  exit $status
fi
"$PY" -m pytest -q tests --ignore=tests/test_cuda.py 2>&1 | tee "$logs/dcp_rest_tests.log" || status=1
echo "bench/gpu/run.sh: the rest of the suite on the GPU machine: $(tail -1 "$logs/dcp_rest_tests.log")"
exit $status
