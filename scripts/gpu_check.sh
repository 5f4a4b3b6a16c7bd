#!/bin/bash
# The GPU check, one command on a machine with a CUDA GPU and PyTorch (CUDA build):
#
#     scripts/gpu_check.sh            # from the repository's root or anywhere
#
# It runs scripts/gpu_check.py: greedy parity with transformers and batching invariance on CUDA
# (float32), then `ferry bench`'s offline runs in bfloat16 (mixed-64, and one 1024-in/128-out
# request), then `ferry simulate`'s H200 preset on the same workloads, and prints one summary.
# Set-up: ferry's Python dependencies (torch, numpy, safetensors, tokenizers, transformers, tqdm,
# prometheus-client) must import. On a machine without network access, wheels carried in .whl/
# are installed first. The model's shape (config.json and tokenizer) comes from the embedded
# SmolLM2 when it is installed, else from .gpu/smollm2-config (`make gpu-prep` fills .gpu/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ferry-site .whl/*.whl
    export PYTHONPATH=/tmp/ferry-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# A networked machine without ferry's dependencies gets them (torch from PyPI is its CUDA build).
$PY -c "import numpy, safetensors, tokenizers, transformers, tqdm, prometheus_client" 2>/dev/null \
    || $PY -m pip install -q -e .
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible to torch')"
# The device-parametrised tests: their CUDA cases run here (on a CPU machine they are skipped).
$PY -m pytest -q -p no:cacheprovider tests/test_device.py -rs
CONFIG_DIR=${CONFIG_DIR:-.gpu/smollm2-config}
WORKLOAD=${WORKLOAD:-.gpu/mixed-64.json}
[ -f "$WORKLOAD" ] || WORKLOAD=benchmarks/workloads/mixed-64.json
exec $PY scripts/gpu_check.py --config-dir "$CONFIG_DIR" --workload "$WORKLOAD" --out "${OUT:-/tmp}/gpu_check.json"
