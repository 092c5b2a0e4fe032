#!/usr/bin/env bash
# Every GPU check of labrl, on a CUDA node, in one command (docs/gpu.md):
#   bash benchmarks/gpu_check.sh                 # GPU tests + learner/sampler benchmark
#   QUICKSTART_SEEDS="0 1 2" bash benchmarks/gpu_check.sh   # + the quickstart on CUDA, per seed
# Offline nodes: put the wheels listed in docs/gpu.md into .whl/ beside this repository first;
# they are installed with --no-index into /tmp (the node's own CUDA torch is kept).
# Results (logs, JSON) go to $OUT (default benchmarks/results/gpu_check/).
# The GPU tests include the weight-sync checks (tests/gpu/test_weight_sync_gpu.py: bf16 bucketed export
# on CUDA, the update group over gloo with CUDA tensors on one GPU, over NCCL with two GPUs) and the
# real TP=2 learner (tests/gpu/test_learner_tp2_gpu.py: export gather, sequence-parallel router
# replay): the NCCL and TP=2 ones need two visible GPUs (NCCL refuses two ranks on one device) and
# are reported as skipped, with that reason, on a one-GPU node.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import labrl.harness" 2>/dev/null; then
  if [ -d .whl ]; then
    echo "installing labrl offline from .whl/ into /tmp/labrl-site*"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/labrl-site .whl/*.whl
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/labrl-site2 .
    export PYTHONPATH=/tmp/labrl-site2:/tmp/labrl-site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "labrl is not importable and there is no .whl/ to install it from: pip install -e . (keeps your torch)" >&2
    exit 2
  fi
fi

"$PY" - <<'PY' | tee "$OUT/device.txt"
import torch
from labrl.harness.models import device as dev
caps = dev.detect_capabilities()
assert caps.cuda, "no CUDA device visible: nothing to check"
d = dev.resolve_device("auto", caps)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.device_count()} GPU(s) visible")
print(f"capabilities: {caps}")
print(f"layer spec: {dev.layer_spec(d, caps)}")
print(f"workarounds: {dev.workarounds(d, caps)}")
PY

status=0
"$PY" -m pytest -m gpu tests/gpu -p no:cacheprovider -q -rs 2>&1 | tee "$OUT/pytest-gpu.txt" || status=1
# the weight-sync and TP=2 checks again, on their own, so their counts stand apart in the logs
"$PY" -m pytest -m gpu tests/gpu/test_weight_sync_gpu.py tests/gpu/test_learner_tp2_gpu.py \
  -p no:cacheprovider -q -rs 2>&1 | tee "$OUT/pytest-gpu-weight-sync.txt" || status=1
"$PY" benchmarks/gpu_learner.py --out "$OUT/gpu_learner.json" 2>&1 | tee "$OUT/gpu_learner.txt" || status=1

for seed in ${QUICKSTART_SEEDS:-}; do
  "$PY" -m labrl.cli train configs/quickstart.yaml "seed=$seed" "run_dir=$OUT/quickstart-seed$seed" \
    --no-progress 2>&1 | tee "$OUT/quickstart-seed$seed.txt" || status=1
done
echo "gpu_check: exit $status; logs in $OUT"
exit $status
