#!/usr/bin/env bash
# GPU check in one command: build with CUDA, run the test suite on the GPU, benchmark every CUDA kernel, run the demo
# on GPU ranks (NCCL), and append both tables to bench/RESULTS.md. Exits 2 (and says so) where no GPU is found.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench/gpu/run.sh: no GPU found (nvidia-smi lists none); nothing was run." >&2
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$cap}" DCP_OPS_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
bash scripts/setup.sh
.venv/bin/python -m pytest -q tests 2>&1 | tee /tmp/dcp_gpu_tests.log
.venv/bin/python bench/gpu/bench_cuda.py --json bench/gpu/last.json | tee /tmp/dcp_gpu_bench.txt
.venv/bin/python -m dcp_ops demo --device cuda --dtype bfloat16 | tee /tmp/dcp_gpu_demo.txt
{
  echo
  echo "## GPU — $(date -u +%Y-%m-%d), $gpu (sm_${cap/./}), \`bash bench/gpu/run.sh\`"
  echo
  echo "Tests: $(tail -1 /tmp/dcp_gpu_tests.log)"
  echo
  echo '```'
  cat /tmp/dcp_gpu_bench.txt
  echo '```'
  echo
  echo '`python -m dcp_ops demo --device cuda --dtype bfloat16`:'
  echo
  echo '```'
  cat /tmp/dcp_gpu_demo.txt
  echo '```'
} >> bench/RESULTS.md
echo "appended to bench/RESULTS.md"
