#!/usr/bin/env bash
# Two checkouts of llamarl, benchmarked in alternation on one machine, so that its load
# falls on both alike: benchmarks/async_vs_sync.py (--pairs 1, twice each) and
# benchmarks/weight_sync.py (three times each), then benchmarks/side_by_side.py sums up.
#
#   benchmarks/side_by_side.sh BASE_TREE BASE_PYTHON HEAD_TREE HEAD_PYTHON OUT_DIR
#
# Each tree runs its own benchmarks with its own interpreter (a tree from before the
# `llamarl` namespace needs its own virtualenv; a later one may run on a shared one with
# PYTHONPATH set by the caller). Writes OUT_DIR/{avs,ws}_{base,head}_<i>.json.
set -euo pipefail
BASE=$1 BASE_PY=$2 HEAD=$3 HEAD_PY=$4 OUT=$(realpath -m "$5")
mkdir -p "$OUT"
for i in 1 2; do
  (cd "$BASE" && timeout 3000 "$BASE_PY" benchmarks/async_vs_sync.py --pairs 1 --json "$OUT/avs_base_$i.json")
  (cd "$HEAD" && timeout 3000 "$HEAD_PY" benchmarks/async_vs_sync.py --pairs 1 --json "$OUT/avs_head_$i.json")
done
for i in 1 2 3; do
  (cd "$BASE" && timeout 1200 "$BASE_PY" benchmarks/weight_sync.py --json "$OUT/ws_base_$i.json")
  (cd "$HEAD" && timeout 1200 "$HEAD_PY" benchmarks/weight_sync.py --json "$OUT/ws_head_$i.json")
done
"$HEAD_PY" "$HEAD/benchmarks/side_by_side.py" "$OUT" --json "$OUT/side_by_side.json"
