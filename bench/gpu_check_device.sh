#!/usr/bin/env bash
# The GPU check on a lent GPU node whose image has torch but not the worker's other packages: installs the wheels
# carried in .whl/ into a scratch folder put on PYTHONPATH (the node's own torch, numpy and huggingface_hub stay),
# prints what it runs on, and runs `python3 -m bench.gpu_check` with its output teed to $OUT/gpu-check.log and its
# results folder in $OUT/gpu-check (rewritten after each line, so a run cut off leaves what it measured; $OUT is the
# folder the device tool brings back, bench/results/gpu-check-device without one).
#
#     bash bench/gpu_check_device.sh [bench.gpu_check options, e.g. --lines sd15 flux.bf16 --budget 300]
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${GPU_CHECK_SITE:-/tmp/site}
OUT=${OUT:-$PWD/bench/results/gpu-check-device}
RESULTS="$OUT/gpu-check"
mkdir -p "$OUT"
started=$(date +%s)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 1; }
  echo "carried wheels installed into $SITE in $(( $(date +%s) - started ))s"
else
  echo "no .whl/ folder: using the packages already installed"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
python3 - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import importlib, sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("diffusers", "transformers", "peft", "torchao", "pydantic", "huggingface_hub"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001 - reported, the check says what it misses
        print(name, "absent:", type(exc).__name__, exc)
PY
python3 -m bench.gpu_check --out "$RESULTS" "$@" 2>&1 | tee "$OUT/gpu-check.log"
rc=${PIPESTATUS[0]}
echo "exit $rc; $(( $(date +%s) - started ))s in all; log and results in $OUT"
exit "$rc"
