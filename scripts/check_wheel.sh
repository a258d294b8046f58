#!/usr/bin/env bash
# The deployable package: builds a wheel with `pip wheel --no-build-isolation .` (against .venv's torch; make .venv
# with scripts/setup.sh first), installs it into a fresh venv with the same torch, and runs the test suite there
# from a copy of the repository without the dcp_ops/ source package, so every test imports the installed wheel.
#   bash scripts/check_wheel.sh [WORKDIR]      (default: a new temporary directory; about 20 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-$(mktemp -d)}
mkdir -p "$work"
torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
.venv/bin/python -m pip wheel -q --no-build-isolation --no-deps . -w "$work/dist"
wheel=$(ls "$work"/dist/dcp_ops-*.whl)
echo "check_wheel: built $wheel"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$torch_version" numpy pytest hypothesis \
  ninja setuptools transformers==5.25.0 "$wheel"
rm -rf "$work/src" && mkdir -p "$work/src"
git ls-files -z | grep -zv '^dcp_ops/' | xargs -0 cp --parents -t "$work/src"
cd "$work/src"
"$work/venv/bin/python" -c "import dcp_ops, os; assert 'site-packages' in dcp_ops.__file__, dcp_ops.__file__; \
print('check_wheel: testing', dcp_ops.__file__, '; CPU ISA', dcp_ops._C.cpu_isa, '; CUDA archs', dcp_ops._C.cuda_archs)"
"$work/venv/bin/python" -m pytest -q tests
