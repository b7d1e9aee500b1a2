#!/usr/bin/env bash
# The whole GRPO loop on the GPU box (Ray + verl main_ppo + Megatron + vLLM), through the launcher, unchanged.
# The box reaches no registry: the environment comes as parts of the bundle of scripts/gpu-box.lock
# (docs/gpu-setup.md), one part per device call, kept outside the work tree.
#
#   bash scripts/gpu_grpo.sh receive     # copy the carried .gpu-parts/* to $PARTS (once per part)
#   bash scripts/gpu_grpo.sh install     # check + join + install them into $GPUBOX, then import vllm, ray, verl, TE
#   bash scripts/gpu_grpo.sh tiny        # GPUs 0,1,2 side by side: tiny_1xH100 sound (12 steps), its flipped-advantage
#                                        #   twin (6 steps, must FAIL), and a run whose EngineCore is killed after step 3
#   bash scripts/gpu_grpo.sh tiny1       # one GPU: tiny_1xH100 sound (12 steps) and its flipped-advantage twin (6
#                                        #   steps, must FAIL) side by side on GPU 0 (two Ray clusters on one host)
#   bash scripts/gpu_grpo.sh proxy1      # one GPU: proxy_1xH100, whole GRPO steps (TE spec, CPU optimizer;
#                                        #   PROXY1_STEPS steps, default 4)
#   bash scripts/gpu_grpo.sh proxy1fp8   # one GPU: proxy_1xH100_fp8 (FP8 rollout weights) on proxy1's model, mcore
#                                        #   checkpoint and data (run proxy1 first): the same prompts, BF16 vs FP8
#   bash scripts/gpu_grpo.sh proxy       # 4 GPUs: proxy_4xH100, whole GRPO steps (TE spec)
#   bash scripts/gpu_grpo.sh twonode     # 4 GPUs as two Ray nodes of 2 GPUs (ray start --head / --address, node 0
#                                        #   submits: the launcher's multi-node path, PAI-DLC variables)
#   bash scripts/gpu_grpo.sh oso2 [sync] # 2 GPUs, in turn on GPUs 0,1: tiny_2xH100_one_step_off (trainer GPU 0, vLLM
#                                        #   GPU 1, nccl weight sync with the refit manifest; 12 steps, must PASS), then
#                                        #   its flipped-advantage twin (6 steps, must FAIL); `sync`: then tiny_2xH100
#   bash scripts/gpu_grpo.sh oso2proxy   # 2 GPUs, in turn: proxy_2xH100 (sync, colocated) then proxy_2xH100_one_step_off,
#                                        #   OSO2_STEPS steps each (default 3), on proxy1's model, mcore checkpoint and
#                                        #   data when proxy1 ran on this box, else on those the first run prepares
#   bash scripts/gpu_grpo.sh wait MODE [SECONDS]   # wait for MODE's runs (progress lines), then pack them
#
# The modes start their runs detached (setsid: they outlive the call), copy the work tree to $RUNS/repo-MODE first (a
# later call's fresh copy of the tree cannot change a running run's code), wait up to $WAIT_S seconds, and pack each
# run's log directory (report.json, metrics.jsonl, PNGs, main_ppo.log, the launcher's output, gpu-use.csv: memory and
# utilisation of the run's GPUs every 5 s) into $OUT/MODE.tar.gz. `wait MODE` goes on waiting in the next call. A run
# started in turn (oso2, oso2proxy) is `queued` until the run before it has ended and its GPUs are free.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${PARTS:-/root/dsv3-parts}
export DSV3_GPUBOX=${DSV3_GPUBOX:-/root/dsv3-env}
RUNS=${RUNS:-/root/dsv3-runs}
OUT=${OUT:-out/gpu-grpo}
WAIT_S=${WAIT_S:-540}
mkdir -p "$OUT" "$RUNS"
mode=${1:?mode: receive | install | tiny | tiny1 | proxy1 | proxy1fp8 | proxy | twonode | oso2 [sync] | oso2proxy | wait MODE [SECONDS]}

case $mode in
  receive)
    mkdir -p "$PARTS"
    for f in .gpu-parts/*; do cp "$f" "$PARTS/"; echo "received $(basename "$f") ($(stat -c %s "$f") bytes)"; done
    ls "$PARTS" | tr '\n' ' '; echo
    exit 0 ;;
  install)
    t0=$SECONDS
    python3 -m dsv3_rl.gpubox install "$PARTS" --target "$DSV3_GPUBOX" || exit $?
    source scripts/gpu_env.sh
    DSV3_GPU_TE=1 source scripts/gpu_env.sh
    python3 - <<'PY'
import time; t = time.time()
import ray, vllm, transformers, pydantic, hydra, tensordict, math_verify, transfer_queue
import verl.trainer.main_ppo, megatron.core
import transformer_engine.pytorch as te
print(f"imports ok ({time.time() - t:.1f} s): ray {ray.__version__}, vllm {vllm.__version__}, transformers "
      f"{transformers.__version__}, TE {te.__version__ if hasattr(te, '__version__') else 'ok'}")
PY
    echo "install + import check: $((SECONDS - t0)) s"
    exit 0 ;;
esac

# the bundle on PYTHONPATH (its Transformer Engine too for the proxy runs: the held-out check's TE spec), backends/
# check, NVLink multicast off
if [[ $mode == *proxy* || $mode == twonode || ${2:-} == *proxy* || ${2:-} == twonode ]]; then export DSV3_GPU_TE=1; fi
source scripts/gpu_env.sh
export PYTHON=python3

pack() {  # pack MODE: every run of MODE's log dir + launcher output into $OUT/MODE.tar.gz
  local m=$1
  local dest; dest="$(cd "$OUT" && pwd)/$m.tar.gz"
  (cd "$RUNS" && tar czf "$dest" --exclude='*/ckpt' --exclude='*/models' --exclude='*/data' \
      --exclude='*/tensorboard' --exclude='*/ray' $(ls -d "$m"-* 2>/dev/null | grep -v "^repo-") 2>/dev/null)
  echo "packed $dest ($(stat -c %s "$dest" 2>/dev/null) bytes)"
}

status() {  # status MODE: one line per run; returns 0 when every run of MODE has ended
  local m=$1 all=0 d
  for d in "$RUNS/$m"-*/; do
    [ -d "$d" ] || continue
    local n; n=$(basename "$d"); [[ $n == repo-* ]] && continue
    local last; last=$(grep -E "^\[dsv3-grpo\] (step|GRPO)|RESTART|FAILED|error:" "$d/launcher.log" 2>/dev/null | tail -n 1)
    if [ -f "$d/rc" ]; then echo "  $n: exit $(cat "$d/rc"): $last"
    elif [ -f "$d/queued" ]; then echo "  $n: queued: $(cat "$d/queued")"; all=1
    else echo "  $n: running: $last"; all=1; fi
  done
  return $all
}

wait_for() {  # wait_for MODE SECONDS
  local m=$1 lim=$2 t0=$SECONDS
  while [ $((SECONDS - t0)) -lt "$lim" ]; do
    if status "$m" >/dev/null; then break; fi
    sleep 10
  done
  echo "=== $m after $((SECONDS - t0)) s:"; status "$m"; pack "$m"
}

# the detached part of a run: wait for AFTER's run to end (its rc) and its GPUs to empty, sample the GPUs, launch
read -r -d '' RUN_SH <<'SH'
d=$1 after=$2 gpus=$3; shift 3
if [ -n "$after" ]; then
  waited=0  # bounded: a run killed before it wrote its rc must not leave this one queued for ever
  while [ ! -f "$after/rc" ]; do
    if [ "$waited" -ge "${AFTER_WAIT_S:-7200}" ]; then
      echo "[gpu_grpo] $(basename "$after") wrote no exit code in ${AFTER_WAIT_S:-7200} s: not started"; rm -f "$d/queued"
      echo 124 > "$d/rc"; exit 0
    fi
    sleep 5; waited=$((waited + 5))
  done
  for _ in $(seq 60); do  # the run before has exited; its CUDA contexts may take a moment to go (2 minutes at most)
    busy=$(nvidia-smi -i "$gpus" --query-gpu=memory.used --format=csv,noheader,nounits | awk '$1 > 1024' | wc -l)
    [ "$busy" = 0 ] && break; sleep 2
  done
  echo "[gpu_grpo] $(date -u +%T) $(basename "$after") ended (exit $(cat "$after/rc")); GPU(s) $gpus: $busy busy"
  rm -f "$d/queued"
fi
( while :; do nvidia-smi -i "$gpus" --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv,noheader; sleep 5; done ) \
    > "$d/gpu-use.csv" 2>&1 &
sampler=$!
bash examples/deepseek_v3/run_mcore_deepseek_verl.sh --preset "$@"
rc=$?
kill "$sampler" 2>/dev/null
echo "$rc" > "$d/rc"
SH

start() {  # [AFTER=RUN_DIR] start MODE NAME GPUS PRESET [VAR=VALUE ...] -- [launcher args]
  local m=$1 name=$2 gpus=$3 preset=$4; shift 4
  local envs=() d="$RUNS/$m-$name" after=${AFTER:-}
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  mkdir -p "$d"; rm -f "$d/rc" "$d/queued"
  [ -n "$after" ] && echo "after $(basename "$after")" > "$d/queued"
  local repo="$RUNS/repo-$m"
  ( cd "$repo" && source scripts/gpu_env.sh && setsid env CUDA_VISIBLE_DEVICES="$gpus" WORK_DIR="$d/work" PYTHON=python3 "${envs[@]}" \
      bash -c "$RUN_SH" run "$d" "$after" "$gpus" "$preset" "$@" > "$d/launcher.log" 2>&1 < /dev/null & )
  echo "${after:+queued after $(basename "$after"): }started $m-$name on GPU(s) $gpus: $preset $* ${envs[*]}"
}

snapshot() {  # copy the work tree (with the carried backends/) to $RUNS/repo-MODE
  local repo="$RUNS/repo-$1"
  rm -rf "$repo"; mkdir -p "$repo"
  tar cf - --exclude=./.gpu-parts --exclude=./out --exclude=./.git . | (cd "$repo" && tar xf -)
}

nvidia-smi -L
case $mode in
  tiny)
    snapshot tiny
    start tiny sound 0 tiny_1xH100
    start tiny flip 1 tiny_1xH100 DSV3_PLANT_FAULT=flip_advantage_sign -- trainer.total_training_steps=6
    start tiny kill 2 tiny_1xH100
    ( cd "$RUNS/repo-tiny" && setsid python3 scripts/kill_at_step.py "$RUNS/tiny-kill/work/logs/dsv3_rl_demo/grpo_tiny_1xH100" 3 \
        > "$RUNS/tiny-kill/kill.log" 2>&1 < /dev/null & )
    wait_for tiny "$WAIT_S" ;;
  tiny1)
    snapshot tiny1
    start tiny1 sound 0 tiny_1xH100
    start tiny1 flip 0 tiny_1xH100 DSV3_PLANT_FAULT=flip_advantage_sign -- trainer.total_training_steps=6
    wait_for tiny1 "$WAIT_S" ;;
  proxy1)
    snapshot proxy1
    start proxy1 one 0 proxy_1xH100 -- trainer.total_training_steps="${PROXY1_STEPS:-4}"
    wait_for proxy1 "$WAIT_S" ;;
  proxy1fp8)
    snapshot proxy1fp8
    w="$RUNS/proxy1-one/work"
    start proxy1fp8 one 0 proxy_1xH100_fp8 MODEL_PATH="$w/models/dsv3-proxy-1xh100" MCORE_PATH="$w/models/dsv3-proxy-1xh100-mcore" \
        DATA_DIR="$w/data/math_lighteval" -- trainer.total_training_steps="${PROXY1_STEPS:-4}"
    wait_for proxy1fp8 "$WAIT_S" ;;
  proxy)
    snapshot proxy
    start proxy one 0,1,2,3 proxy_4xH100
    wait_for proxy "$WAIT_S" ;;
  twonode)
    snapshot twonode
    port=$(python3 -c "from dsv3_rl.ports import free_port; print(free_port())")
    w="$RUNS/proxy-one/work"  # the proxy run's model, mcore checkpoint and data (its stages skip them as done)
    common=(DSV3_PLATFORM=dlc MASTER_ADDR=127.0.0.1 WORLD_SIZE=2 KUBERNETES_CONTAINER_RESOURCE_GPU=2 RAY_PORT="$port"
            MODEL_PATH="$w/models/dsv3-proxy-4xh100" MCORE_PATH="$w/models/dsv3-proxy-4xh100-mcore"
            DATA_DIR="$w/data/math_lighteval")
    start twonode node0 0,1 proxy_4xH100 "${common[@]}" RANK=0 RAY_TMPDIR=/tmp/ray-n0 -- trainer.nnodes=2 \
        trainer.n_gpus_per_node=2 trainer.total_training_steps=2
    start twonode node1 2,3 proxy_4xH100 "${common[@]}" RANK=1 RAY_TMPDIR=/tmp/ray-n1 -- trainer.nnodes=2 \
        trainer.n_gpus_per_node=2 trainer.total_training_steps=2
    wait_for twonode "$WAIT_S" ;;
  oso2)
    snapshot oso2
    start oso2 sound 0,1 tiny_2xH100_one_step_off DSV3_REFIT_MANIFEST=1
    AFTER="$RUNS/oso2-sound" start oso2 flip 0,1 tiny_2xH100_one_step_off DSV3_REFIT_MANIFEST=1 \
        DSV3_PLANT_FAULT=flip_advantage_sign -- trainer.total_training_steps=6
    if [ "${2:-}" = sync ]; then AFTER="$RUNS/oso2-flip" start oso2 sync 0,1 tiny_2xH100; fi
    wait_for oso2 "$WAIT_S" ;;
  oso2proxy)
    snapshot oso2proxy
    w="$RUNS/proxy1-one/work"  # proxy1's model, mcore checkpoint and data (as proxy1fp8), else the first run's own
    [ -f "$w/models/dsv3-proxy-1xh100-mcore/dsv3_manifest.json" ] || w="$RUNS/oso2proxy-sync/work"
    inputs=(MODEL_PATH="$w/models/dsv3-proxy-1xh100" MCORE_PATH="$w/models/dsv3-proxy-1xh100-mcore"
            DATA_DIR="$w/data/math_lighteval")
    start oso2proxy sync 0,1 proxy_2xH100 "${inputs[@]}" -- trainer.total_training_steps="${OSO2_STEPS:-3}"
    AFTER="$RUNS/oso2proxy-sync" start oso2proxy osp 0,1 proxy_2xH100_one_step_off DSV3_REFIT_MANIFEST=1 "${inputs[@]}" \
        -- trainer.total_training_steps="${OSO2_STEPS:-3}"
    wait_for oso2proxy "$WAIT_S" ;;
  wait)
    wait_for "${2:?wait MODE}" "${3:-$WAIT_S}" ;;
  *) echo "error: unknown mode $mode" >&2; exit 2 ;;
esac
