# The A/B of tiny_host_copies_ab.py on a GPU node, from the repository root: .whl/ holds the
# offline wheels of docs/gpu.md with the new labrl wheel, .whl-old/ the old labrl wheel only.
set -u
R=benchmarks/results/gpu_h100_2026-11-27
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps .whl/*.whl 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/old .whl-old/*.whl 2>/dev/null
for round in 1 2; do
  for code in old new; do
    if [ "$code" = old ]; then P=/tmp/old:/tmp/deps; else P=/tmp/deps; fi
    PYTHONPATH=$P timeout 60 python3 "$R/tiny_host_copies_ab.py" 2>/dev/null | tee -a "$OUT/tiny.jsonl"
  done
done
