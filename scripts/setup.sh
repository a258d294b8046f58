#!/usr/bin/env bash
# One-time (and incremental) setup on a fresh machine: a virtualenv in .venv with torch 2.14.1, numpy (without it
# torch warns on every import), the test tools, transformers (examples/hf_generate.py and its tests), and dcp_ops._C
# built in place (CUDA sources too when nvcc is found; see setup.py for the switches).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch 2.14.1 is a CUDA build: 5.6 GB of disk at peak (measured in CI). Say so up front when the disk is short, since
# pip's own message on a full disk ("[Errno 28] No space left on device") does not say how much it needs.
read -r free_kb mount < <(df -Pk . | awk 'NR == 2 { print $4, $6 }')
if ! .venv/bin/python -c 'import torch' 2>/dev/null && [ "${free_kb:-0}" -lt $((8 * 1024 * 1024)) ]; then
  echo "setup.sh: warning: $((free_kb / 1024)) MB free on $mount; installing torch 2.14.1 needs about 8 GB" >&2
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.14.1 numpy pytest hypothesis ninja setuptools \
  transformers==5.25.0
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
mkdir -p build  # the compiler's output, which scripts/check_warnings.py reads (CI fails on a warning of ours)
.venv/bin/python setup.py -q build_ext --inplace 2>&1 | tee build/build.log
.venv/bin/python -c "import dcp_ops, torch; print('dcp_ops', dcp_ops.__version__, 'built; CPU ISA', dcp_ops._C.cpu_isa, '; CUDA archs', dcp_ops._C.cuda_archs or None, '; torch', torch.__version__)"
