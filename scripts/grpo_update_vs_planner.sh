#!/usr/bin/env bash
# The GRPO update bench against the planner (issue 25, "measured against the planner"): on 4 GPUs the planner's
# 3 best layouts for the proxy_4xH100 model and the one it rejects as out of memory, on 2 GPUs its 2 best for the
# same model with 2 layers (both 2-GPU runs at once, on GPUs 0-1 and 2-3). Every result is a JSON under $OUT
# (bench_<tag>.json; an out-of-memory run gets a {"status": "oom", "config": ...} stub), every log $OUT/<tag>.log.
# The predictions are registered before the run in docs/results/2026-11-26-grpo-update/ (below: which file); the
# last step compares (dsv3-plan validate). Measured on 4 x H100 (2026-11-26): ~5 min for every row.
#
#   OUT=/tmp/out bash scripts/grpo_update_vs_planner.sh          # all rows
#   ROWS="best1 oom" bash scripts/grpo_update_vs_planner.sh      # some of them
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/grpo-update}
mkdir -p "$OUT"
source scripts/gpu_env.sh  # carried wheels, backends/ check, PYTHONPATH, NVLink multicast off
# The rows (tag, layout, model overrides, GPUs) are the planner's, registered before the run: predicted-v2.json for
# H100 (80 GB), predicted-h200-v2.json for H200 (141 GB: 6 layers, so that the best layouts fill it and the rejected
# one really overflows), both from the planner as fixed after the first H100 measurement (docs/planner.md);
# predicted.json / predicted-h200.json stay as what was predicted before it. PRED=... picks a file by hand.
MEM_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
if [ -z "${PRED:-}" ]; then
  PRED=docs/results/2026-11-26-grpo-update/predicted-v2.json
  [ "${MEM_MIB:-0}" -gt 100000 ] && PRED=docs/results/2026-11-26-grpo-update/predicted-h200-v2.json
fi
echo "rows from $PRED (GPU memory ${MEM_MIB:-?} MiB)"
# the batch the planner predicted for (docs/planner.md): 8 prompts x 8, prompt 512, responses uniform 256..2048
# (mean 1152), <= 6144 tokens per micro-batch per GPU, one optimizer step, local spec (BSHD, padded), BF16, no recompute
BATCH=(--model proxy_4xH100 --prompts 8 --rollout-n 8 --prompt-len fixed:512 --resp-len uniform:256:2048 --max-token-len 6144
       --mini-batches 1 --steps 2 --warmup 1 --spec local --precision bf16 --recompute none)
declare -A LAYOUT SETS WORLD
ORDER=()
while read -r tag layout sets world; do LAYOUT[$tag]=$layout; SETS[$tag]=$sets; WORLD[$tag]=$world; ORDER+=("$tag"); done < <(
  python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['runs']:
    print(r['tag'], r['layout_arg'], ','.join(f'{k}={v}' for k, v in r['model_set'].items()) or '-', r['world'])" "$PRED")
ROWS=${ROWS:-"${ORDER[*]}"}

bench() {  # bench TAG GPUS [extra args]: one torchrun; an out-of-memory failure leaves an oom stub
  local tag=$1 n=$2; shift 2
  local t0=$SECONDS rc=0
  local limit=240; [ "$tag" = oom ] && limit=150  # the OOM run must fail in its first update, not hang
  local sets=(); [ "${SETS[$tag]}" != - ] && sets=(--set "${SETS[$tag]}")
  local prof=(); [ "$tag" = "${PROFILE_ROW:-}" ] && prof=(--profile "$OUT/prof-$tag")  # PROFILE_ROW=best1: its profile
  timeout "$limit" torchrun --standalone --nproc-per-node "$n" bench/bench_grpo_update.py "${BATCH[@]}" \
    --layout "${LAYOUT[$tag]}" "${sets[@]}" "${prof[@]}" "$@" --json "$OUT/bench_$tag.json" > "$OUT/$tag.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ] && grep -qiE "out of memory|OutOfMemoryError" "$OUT/$tag.log"; then
    python3 - "$OUT/bench_$tag.json" "$OUT/$tag.log" "${LAYOUT[$tag]}" "$n" "${sets[*]}" <<'EOF'
import sys
from dsv3_rl.fs import write_json_atomic
from dsv3_rl.planner.validation import oom_stub
path, log, layout, world, extra = sys.argv[1:]
sets = extra.split()[1::2] if extra.startswith("--set") else []
cfg = dict(model="proxy_4xH100", set=sets, layout=layout, world=int(world), prompts=8, n=8, prompt_len="fixed:512",
           resp_len="uniform:256:2048", max_token_len_per_gpu=6144, mini_batches=1, spec="local", precision="bf16",
           recompute="none", distributed_optimizer=True)
write_json_atomic(path, oom_stub(cfg, open(log, errors="replace").read()))
EOF
    echo "$tag: out of memory (rc=$rc) in $((SECONDS - t0)) s; stub $OUT/bench_$tag.json"
  else
    echo "$tag: rc=$rc in $((SECONDS - t0)) s: $(grep -E '^grpo update bench' "$OUT/$tag.log" | tail -n 1)"
  fi
}

for tag in $ROWS; do
  case $tag in
    2gpu-*) ;;  # below, two at once
    *) bench "$tag" 4 ;;
  esac
done
two=($(for t in $ROWS; do case $t in 2gpu-*) echo "$t" ;; esac; done))
gpus=(0,1 2,3)
for i in "${!two[@]}"; do
  CUDA_VISIBLE_DEVICES=${gpus[$((i % 2))]} bench "${two[$i]}" 2 &
  if [ $((i % 2)) -eq 1 ]; then wait; fi
done
wait
python3 -m dsv3_rl.planner validate "$OUT"/bench_*.json --predicted "$PRED"
