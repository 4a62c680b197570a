#!/usr/bin/env bash
# The GPU check of the vLLM path, prepared to run as one command on a CUDA machine (about 10 minutes):
# a venv with the `gpu` extra (vLLM and the torch it pins), the vLLM and GPU tests, then
# `bench/vllm_check.py --device cuda --json`, whose one JSON object is the result. What only a GPU can
# confirm is here: CUDA graphs across a reload, CUDA bf16 numerics, NCCL where several GPUs are lent.
# Logs and the JSON go to $OUT (default /tmp/echo2-gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/echo2-gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ ! -x .venv-gpu/bin/python ]; then
    python3 -m venv .venv-gpu
    .venv-gpu/bin/python -m pip install -q --upgrade pip
    .venv-gpu/bin/pip install -q -e ".[gpu,dev]" 2>&1 | tail -5
fi
. .venv-gpu/bin/activate
python -c "import torch, vllm; assert torch.cuda.is_available(); print('torch', torch.__version__, 'vllm', vllm.__version__)" | tee -a "$OUT/gpu.txt"
set +e
PYTHONUNBUFFERED=1 timeout 300 python -m pytest -q -p no:cacheprovider -n 0 -m "gpu or vllm" tests/ 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 timeout 420 python bench/vllm_check.py --device cuda --json --out "$OUT/run" > "$OUT/vllm_check.json" 2> "$OUT/vllm_check.err"
check_rc=$?
set -e
python - "$OUT" "$tests_rc" "$check_rc" <<'PY'
import json, pathlib, sys
out, tests_rc, check_rc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
text = (out / "vllm_check.json").read_text().strip()
summary = {"gpu_tests_rc": tests_rc, "vllm_check_rc": check_rc,
           "gpu_tests_tail": (out / "gpu-tests.log").read_text()[-300:],
           "result": json.loads(text) if text else None,
           "error": (out / "vllm_check.err").read_text()[-1500:] if check_rc else None}
print(json.dumps(summary, sort_keys=True))
PY
