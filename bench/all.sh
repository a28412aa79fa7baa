#!/usr/bin/env bash
# One dated run of every figure bench/README.md's "Issue 19" table shows, one script after another (never two
# benchmarks at once: they share the cores). Logs go to bench/results/<script>.log beside the JSON files.
#   bash bench/all.sh            # ~60 min on 2 cores (quiet)
#   SCRIPTS="scaling colocated" bash bench/all.sh   # some of them, appended to all.log
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
date -u +"started %Y-%m-%dT%H:%M:%SZ at $(git rev-parse --short HEAD)" | tee ${SCRIPTS:+-a} bench/results/all.log
for script in ${SCRIPTS:-vs_trl startup dataplane async_vs_sync scaling colocated}; do
  start=$(date +%s)
  "$PY" "bench/$script.py" > "bench/results/$script.log" 2>&1
  echo "$script: $(( $(date +%s) - start )) s" | tee -a bench/results/all.log
done
date -u +"finished %Y-%m-%dT%H:%M:%SZ" | tee -a bench/results/all.log
