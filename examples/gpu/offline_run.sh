# On the offline GPU machine, from the root of the copy that holds the bundle (examples/gpu/offline_bundle.sh):
# unpack, check the imports, run the acceptance parts in three lanes into $OUT. ACC_PARTS and ACC_TIMEOUT override.
set -o pipefail
R=$(pwd) B=${BUNDLE:-.devrun} OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 "$B/install.py" /tmp/site /tmp/repo || exit 3
export PYTHONPATH=/tmp/repo:/tmp/site SCREL_CACHE=/tmp/screl_cache PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
cd /tmp/repo
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, lightning, ray, megatron.core, transfer_queue, jsonargparse, tensordict, screl.cli, screl.strategies, screl.callbacks; print('imports ok: torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'ray', ray.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -5
timeout "${ACC_TIMEOUT:-450}" python3 examples/gpu/acceptance.py --smollm2-random-from "$R/$B/smollm2" \
  --parts "${ACC_PARTS:-grpo,ppo_offload;colocated,megatron_generation;memory,megatron}" \
  --out "$OUT/gpu_acceptance.json" > "$OUT/acceptance_stdout.json" 2> >(tee "$OUT/acceptance.log" >&2)
echo "acceptance exit $?"
ls -la "$OUT"
