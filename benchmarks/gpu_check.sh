#!/usr/bin/env bash
# Every GPU check of labrl, on a CUDA node, in one command (docs/gpu.md):
#   bash benchmarks/gpu_check.sh                 # GPU tests + learner/sampler benchmark (the learner
#                                                # with SequentialMLP and with TorchGroupedMLP experts)
#   QUICKSTART_SEEDS="0 1 2" bash benchmarks/gpu_check.sh   # + the quickstart on CUDA, per seed
#   QUICKSTART_TIMEOUT_S=300 ...   # stop each quickstart after 300 s (resumable; its metrics so far are kept)
#   GPU_LEARNER_BENCH=0 ...        # skip benchmarks/gpu_learner.py and step_profile.py (tests and quickstart only)
#   GPU_PROFILE=0 ...              # skip benchmarks/step_profile.py and its op count (where labrl's step and bare megatron-core's,
#                                  # same experts and precision, spend their time; ~1 min) and
#                                  # benchmarks/compiled_objective.py (the objective eager and compiled; ~1 min)
#   GPU_LEARNER_TIMEOUT_S=300 ...  # stop the benchmark after 300 s (the rows measured so far are kept)
#   GPU_LEARNER_PARTS=sampler ...  # only some of its parts: learner,sampler,attention (default all)
#   GPU_TESTS=0 ...                # skip the GPU tests
#   TRAIN_CONFIG=configs/gpu/quickstart-h100.yaml TRAIN_TIMEOUT_S=560 GPU_TESTS=0 GPU_LEARNER_BENCH=0 ...
#                                  # a config end to end, after everything else (so, for a GPU of its own,
#                                  # with the rest switched off): stopped by SIGINT at TRAIN_TIMEOUT_S with its
#                                  # checkpoint (the same command resumes it), then `labrl report --x time`:
#                                  # held-out accuracy, when it first reached 0.9 in minutes of training, the
#                                  # learner's busy share. $OUT gets train.log, train_report.txt and
#                                  # train_run.tar.gz (metrics, evaluations, warm start, the report's plots).
# The quickstart seeds start first and run concurrently on the one GPU (a 0.6M-parameter model uses
# a sliver of it) while the tests and the learner benchmark run; their run dirs stay in /tmp and
# only logs and metrics are bundled into $OUT/quickstart.tar.gz (checkpoints are not copied).
# Offline nodes: put the wheels listed in docs/gpu.md into .whl/ beside this repository first;
# they are installed with --no-index into /tmp (the node's own CUDA torch is kept).
# Results (logs, JSON) go to $OUT (default benchmarks/results/gpu_check/).
# SDPA attention: tests/gpu/test_sdpa_gpu.py (with the GPU tests) and gpu_learner.py's unfused-attention
# and core-attention rows.
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
    # labrl itself: from its wheel when .whl/ has one (`pip wheel --no-deps -w .whl .`, built where
    # setuptools >= 77 is), else built here
    if ! ls .whl/labrl-*.whl >/dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/labrl-site .
    fi
    export PYTHONPATH=/tmp/labrl-site${PYTHONPATH:+:$PYTHONPATH}
    # `python -m` puts the working directory first on sys.path, where the source folder labrl/ (which
    # holds only part of the package: labrl.envs lives in envs/) would shadow the installed one
    export PYTHONSAFEPATH=1
  else
    echo "labrl is not importable and there is no .whl/ to install it from: pip install -e . (keeps your torch)" >&2
    exit 2
  fi
fi

QS_PIDS=()
QS_DIR=${QS_DIR:-/tmp/labrl-gpu-quickstart}
for seed in ${QUICKSTART_SEEDS:-}; do
  mkdir -p "$QS_DIR"
  OMP_NUM_THREADS=2 timeout --signal=INT "${QUICKSTART_TIMEOUT_S:-0}" \
    "$PY" -m labrl.cli train configs/quickstart.yaml "seed=$seed" "run_dir=$QS_DIR/seed$seed" \
    --no-progress >"$QS_DIR/seed$seed.log" 2>&1 &
  QS_PIDS+=($!)
done

"$PY" - <<'PY' | tee "$OUT/device.txt"
import torch
from labrl.harness.models import device as dev
caps = dev.detect_capabilities()
assert caps.cuda, "no CUDA device visible: nothing to check"
d = dev.resolve_device("auto", caps)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.device_count()} GPU(s) visible")
print(f"capabilities: {caps}")
print(f"layer spec, fp32: {dev.layer_spec(d, caps, torch.float32)}")
print(f"layer spec, bf16: {dev.layer_spec(d, caps, torch.bfloat16)}")  # the experts module differs
print(f"core attention: {dev.core_attention(d, caps)}")
print(f"triton (learner.objective_kernel: compiled): {caps.triton}")
print(f"workarounds: {dev.workarounds(d, caps)}")
PY

status=0
started=$SECONDS
if [ "${GPU_TESTS:-1}" != 0 ]; then
  # -rA: every test's outcome and duration by name, so the log says which GPU check ran and which skipped
  "$PY" -m pytest -m gpu tests/gpu -p no:cacheprovider -q -rA --durations=0 --timeout "${GPU_TEST_TIMEOUT_S:-120}" 2>&1 | tee "$OUT/pytest-gpu.txt" || status=1
fi
if [ "${GPU_LEARNER_BENCH:-1}" != 0 ]; then  # GPU_LEARNER_BENCH=0: tests and quickstart only
  # it writes its JSON after every row, so a benchmark stopped at its time limit keeps what it measured
  echo "[t+$((SECONDS - started))s] GPU tests done; benchmark"
  # PYTHONPATH=benchmarks: the script imports its neighbours (_results, attention_sdpa), and with
  # PYTHONSAFEPATH=1 (the offline install above) Python no longer puts the script's folder on sys.path
  PYTHONPATH=benchmarks${PYTHONPATH:+:$PYTHONPATH} timeout --signal=INT "${GPU_LEARNER_TIMEOUT_S:-0}" \
    "$PY" benchmarks/gpu_learner.py \
    --parts "${GPU_LEARNER_PARTS:-learner,sampler,attention}" --out "$OUT/gpu_learner.json" 2>&1 |
    tee "$OUT/gpu_learner.txt" || status=1
  if [ "${GPU_PROFILE:-1}" != 0 ]; then
    echo "[t+$((SECONDS - started))s] step profile"
    PYTHONPATH=benchmarks${PYTHONPATH:+:$PYTHONPATH} timeout --signal=INT "${GPU_PROFILE_TIMEOUT_S:-0}" \
      "$PY" benchmarks/step_profile.py --out "$OUT/step_profile.json" 2>&1 |
      tee "$OUT/step_profile.txt" || status=1
    # the tiny shape's device ops and reads as CUDA dispatches them (megatron-core's .cpu() reads among
    # them), beside the CPU count in benchmarks/README.md; ~20 s
    PYTHONPATH=benchmarks${PYTHONPATH:+:$PYTHONPATH} timeout --signal=INT "${GPU_PROFILE_TIMEOUT_S:-0}" \
      "$PY" benchmarks/step_profile.py --count-ops --shapes tiny --objective both --out "$OUT/op_count.json" 2>&1 |
      tee "$OUT/op_count.txt" || status=1
    # the objective alone, eager (the default) and compiled (learner.objective_kernel), two objectives, three shapes; ~1 min
    PYTHONPATH=benchmarks${PYTHONPATH:+:$PYTHONPATH} timeout --signal=INT "${GPU_PROFILE_TIMEOUT_S:-0}" \
      "$PY" benchmarks/compiled_objective.py --device cuda --out "$OUT/compiled_objective.json" 2>&1 |
      tee "$OUT/compiled_objective.txt" || status=1
  fi
fi

if [ ${#QS_PIDS[@]} -gt 0 ]; then
  for pid in "${QS_PIDS[@]}"; do
    # 124/130: stopped by QUICKSTART_TIMEOUT_S, which is asked for, not a failure
    wait "$pid" || { rc=$?; [ "$rc" = 124 ] || [ "$rc" = 130 ] || status=1; }
  done
  (cd "$QS_DIR" && tar czf - seed*.log seed*/*.jsonl seed*/*.json 2>/dev/null) >"$OUT/quickstart.tar.gz" || true
  for seed in ${QUICKSTART_SEEDS}; do
    echo "quickstart seed $seed: $(tail -n 2 "$QS_DIR/seed$seed.log" | tr '\n' ' ')"
  done
fi
if [ -n "${TRAIN_CONFIG:-}" ]; then
  TRAIN_DIR=${TRAIN_DIR:-/tmp/labrl-gpu-train/$(basename "$TRAIN_CONFIG" .yaml)}
  mkdir -p "$(dirname "$TRAIN_DIR")"
  echo "[t+$((SECONDS - started))s] labrl train $TRAIN_CONFIG (run_dir=$TRAIN_DIR, stop after ${TRAIN_TIMEOUT_S:-0} s; 0: none)"
  # 124/130: stopped by TRAIN_TIMEOUT_S (asked for, not a failure): its checkpoint resumes it
  timeout --signal=INT "${TRAIN_TIMEOUT_S:-0}" "$PY" -m labrl.cli train "$TRAIN_CONFIG" "run_dir=$TRAIN_DIR" \
    --no-progress >"$OUT/train.log" 2>&1 || { rc=$?; [ "$rc" = 124 ] || [ "$rc" = 130 ] || status=1; }
  tail -n 3 "$OUT/train.log"
  "$PY" -m labrl.cli report "$TRAIN_DIR" --x time --out "$TRAIN_DIR/report" 2>&1 | tee "$OUT/train_report.txt" || status=1
  # not episodes.jsonl / trained.jsonl: per-episode traces, tens of MB at 512 episodes a step
  (cd "$TRAIN_DIR" && tar czf - metrics.jsonl eval.jsonl sft.jsonl ./*.json ./*.yaml report 2>/dev/null) \
    >"$OUT/train_run.tar.gz" || true
fi
echo "gpu_check: exit $status after $((SECONDS - started)) s; logs in $OUT"
exit $status
