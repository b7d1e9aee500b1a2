#!/usr/bin/env bash
# The GPU checks of this repo, in stages that each fit in ~10 minutes on one GPU box, with every
# result written under $OUT (default out/gpu). No vLLM needed: the patched megatron-core tree is put on
# PYTHONPATH. Transformer Engine: when the bundle ../shared/gpu-te is carried as .gpu-te/ (git-ignored), it is
# installed first (~35 s) and every correctness step runs twice, with the TE spec and with megatron's local
# spec (`--spec te|local`; the step name ends in _spec-te / _spec-local, the report and JSON say `spec`).
# Without .gpu-te (or when TE does not import: one line says why) only the local spec runs.
#
#   bash scripts/gpu_session.sh fastpath     # 1 GPU: TE-free fast-path bench + GPU unit tests + fp8 cast bench
#   bash scripts/gpu_session.sh correctness  # 1 GPU: fast-path GPU tests, correctness tp1 fp32, planted faults, bf16 proxy
#   bash scripts/gpu_session.sh memory       # 1 GPU: planner vs measured peak memory (gpu + gpu-act sets, ~1 min)
#   bash scripts/gpu_session.sh two-gpu      # 2 GPUs: correctness layouts over NCCL, faults, planner memory, TP2/EP2 bench
#   bash scripts/gpu_session.sh four-gpu     # 4 GPUs: every 4-process layout + a planted fault at each, both specs;
#                                            #   router replay at EP4, PP2xEP2 (+ EP2, TP2xEP2, PP2), shifted must fail
#   bash scripts/gpu_session.sh te-two       # 2 GPUs, TE spec: every 2-process layout fp32 (+ faults, patch-0001 twin) and bf16
#   bash scripts/gpu_session.sh te           # 4 GPUs (2: one after the other), TE: cuDNN check, MLA attention probe, TE vs local vs transformers bench
#   bash scripts/gpu_session.sh refit        # 1 GPU: refit export bench (BF16, checksum manifest, FP8 + quantize kernel)
#   bash scripts/gpu_session.sh replay       # 1 GPU: router replay record/replay check on the proxy model (+ shifted fault)
#
# Each step has its own time limit; a failing step is reported and the next one still runs.
# Correctness layouts documented as known failures are XFAIL (the step stays ok; an XPASS fails it).
# Ends with one line per step: name, status, seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source scripts/gpu_env.sh  # carried wheels, backends/ check, PYTHONPATH, NVLink multicast off
SUMMARY=()
LANES=()

step() {  # step NAME LIMIT_S CMD...  (inside a lane: output only to $OUT/NAME.log, its last lines echoed at the end)
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc=0
  echo "=== $name (limit ${limit}s): $*"
  if [ -n "${LANE:-}" ]; then
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
  else
    timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
  fi
  local st=ok; [ "$rc" -eq 0 ] || st="FAIL(rc=$rc)"; [ "$rc" -eq 124 ] && st="TIMEOUT"
  SUMMARY+=("$name $st $((SECONDS - t0))s")
  if [ -n "${LANE:-}" ]; then
    echo "$name $st $((SECONDS - t0))s" >> "$OUT/.lane-$LANE"
    { grep -E "^(correctness|replay check|PASS \(|FAIL|error:|te:|fp32: TF32)" "$OUT/$name.log" | tail -n 4; } | sed "s/^/    [$name] /"
  fi
  echo "=== $name: $st in $((SECONDS - t0))s"
}

# Lanes: independent groups of steps run side by side (the tiny-model checks leave the GPUs and 64 cores mostly
# idle; processes of different lanes share GPUs, each NCCL job with its own ranks on distinct GPUs).
lane() {  # lane NAME FUNCTION [ARGS...]: run FUNCTION's steps in the background
  local l=$1; shift
  rm -f "$OUT/.lane-$l"; LANES+=("$l")
  ( LANE=$l; "$@" ) &
}
lanes_wait() {  # wait for every lane; their step lines join the summary
  wait
  local l
  for l in "${LANES[@]}"; do
    [ -f "$OUT/.lane-$l" ] && mapfile -t -O "${#SUMMARY[@]}" SUMMARY < "$OUT/.lane-$l"
    rm -f "$OUT/.lane-$l"
  done
  LANES=()
}

# te_env.pin_torch_cudnn() before megatron imports TE: one cuDNN per process (docs/gpu-setup.md)
nvidia-smi -L; python -c "import torch; from dsv3_rl.mcore import te_env; te_env.pin_torch_cudnn(); import sys, transformers, megatron.core as m; print(sys.executable, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, 'mcore', m.__version__)"

# Transformer Engine from the carried bundle (../shared/gpu-te copied to .gpu-te/; its README): installs what is
# missing into this python's site-packages and smoke-tests te.Linear and an MLA-shaped attention. SPECS is what
# the correctness steps run: "te local" when TE is usable, else "local" (and one line says why).
SPECS=local
if [ -f .gpu-te/install_te.sh ]; then
  step te_install 300 env PY="$(command -v python3)" bash .gpu-te/install_te.sh /tmp
  # TE's NVRTC kernels need cuda_runtime.h at run time; install_te.sh sets this only for its own smoke test
  if [ ! -f /usr/local/cuda/include/cuda_runtime.h ] && [ -z "${NVTE_CUDA_INCLUDE_DIR:-}" ]; then
    NVTE_CUDA_INCLUDE_DIR="$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/nvidia/cu13/include"
    export NVTE_CUDA_INCLUDE_DIR
  fi
  if TE_LINE=$(python -m dsv3_rl.correctness.spec 2>/dev/null | tail -1); then SPECS="te local"; fi
  echo "${TE_LINE:-te: not usable: python -m dsv3_rl.correctness.spec printed nothing}"
  SUMMARY+=("te_check $([ "$SPECS" = local ] && echo FAIL || echo ok) ${TE_LINE:-no output}")
else
  echo "te: not installed (no .gpu-te/ carried): local spec only"
fi

case "${1:-}" in
  fastpath)
    step bench_1gpu 280 python bench/bench_train_step.py --grouped auto,off --json "$OUT/bench-1gpu.json"
    step gpu_unit 130 python -m pytest -q -m gpu tests/gpu/test_fp8_cast_gpu.py tests/gpu/test_mcore_fastpath_gpu.py -p no:cacheprovider
    step fp8_bench 140 env -u TORCHDYNAMO_DISABLE python bench/bench_fp8_cast.py --set num_hidden_layers=2 \
      --workdir /tmp/fp8bench --json "$OUT/fp8.json"
    ;;
  correctness)
    step fastpath_unit 170 python -m pytest -q -s -m gpu tests/gpu/test_mcore_fastpath_gpu.py -p no:cacheprovider
    for S in $SPECS; do
      step "corr_tp1_spec-$S" 100 python -m dsv3_rl.correctness run --spec "$S" --layout tp1 --json "$OUT/gpu1_fp32_$S.json"
      step "corr_faults_spec-$S" 100 python -m dsv3_rl.correctness check-faults --spec "$S" \
        --faults swap-experts,router-bias,yarn-mscale,no-group-routing,rope-interleave-false,rope-interleave-false-unchecked \
        --json "$OUT/gpu1_faults_$S.json"
    done
    S=${SPECS%% *}  # the proxy (7 GB of weights) once: te where it is usable
    step "corr_proxy_bf16_spec-$S" 300 python -m dsv3_rl.correctness run --spec "$S" --layout tp1 --model proxy \
      --set num_hidden_layers=2 --dtype bf16 --batch-size 2 --seq-length 256 --calibrate --work /tmp/proxy \
      --json "$OUT/gpu1_bf16_proxy_$S.json"
    ;;
  memory)
    step planner_mem 200 python bench/measure_train_memory.py --out "$OUT/measured_gpu.jsonl"
    step planner_mem_act 150 python bench/measure_train_memory.py --set gpu-act --out "$OUT/measured_gpu_act.jsonl"
    ;;
  two-gpu)
    # every 2-process layout; the documented known failures (tp2_nosp, pp2_vpp2_batchp2p, tp2_nosp_dense on the
    # local spec) are XFAIL, not FAIL
    for S in $SPECS; do
      step "corr_2gpu_spec-$S" 200 python -m dsv3_rl.correctness run --spec "$S" --layout two --json "$OUT/gpu2_fp32_$S.json"
      step "corr_2gpu_fault_spec-$S" 90 python -m dsv3_rl.correctness check-faults --spec "$S" --layout tp2_sp \
        --faults mla-tp-grad-patch-reverted --json "$OUT/gpu2_faults_$S.json"
    done
    step planner_mem 150 python bench/measure_train_memory.py --out "$OUT/measured_gpu.jsonl"
    step bench_2gpu 130 torchrun --nproc-per-node 2 bench/bench_train_step.py --layout tp=2,etp=1 --layout ep=2,etp=1 --json "$OUT/bench-2gpu.json"
    # router replay over NCCL: record, replay (agreement 1.0, same loss), hold under a perturbed router; shifted must FAIL
    for L in tp=2,sp=true ep=2,etp=1 tp=2,ep=2,etp=1 pp=2; do
      step "replay_${L//[=,]/_}" 120 torchrun --nproc-per-node 2 -m dsv3_rl.consistency.replay_check --model proxy \
        --layout "$L" --json "$OUT/replay_2gpu_${L//[=,]/_}.json"
    done
    step replay_2gpu_shift_must_fail 120 bash scripts/must_fail.sh 'replay check .*fault=shift: FAILED' torchrun --nproc-per-node 2 \
      -m dsv3_rl.consistency.replay_check --model proxy --layout tp=2,ep=2,etp=1 --fault shift
    ;;
  four-gpu)
    # fp32 vs transformers at every 4-process layout (ep4, ep4_allgather, tp2_ep2_dp2, pp2_ep2, pp4_vpp2, tp2_pp2,
    # dp2_ep2), each clean and with a planted fault (swap-experts everywhere; the MLA TP-grad patch reverted at the
    # TP ones); with TE also megatron patch 0001 reverted at tp2_nosp_dense (its twin; must FAIL). One command
    # per spec (all jobs of a world size and megatron tree share one torchrun), the specs side by side.
    corr4() {
      local F=swap-experts,mla-tp-grad-patch-reverted
      [ "$1" = te ] && F=$F,mla-down-proj-patch-reverted
      step "corr_4gpu_spec-$1" 480 python -m dsv3_rl.correctness check-faults --spec "$1" --layout four --each-layout \
        --faults "$F" --json "$OUT/gpu4_fp32_faults_$1.json"
    }
    # router replay over NCCL (verl's RouterReplay; the routes are the router's, the same module in both specs, so
    # the default spec: te where installed): agreement 1.0, the same loss with deterministic kernels, routes held
    # under a perturbed router; the shifted replay must FAIL
    replays() {
      local L N
      for L in ep=4,etp=1:4 pp=2,ep=2,etp=1:4 ep=2,etp=1:2 tp=2,ep=2,etp=1:2 pp=2:2; do
        N=${L##*:}; L=${L%:*}
        step "replay_${N}gpu_${L//[=,]/_}" 120 torchrun --standalone --nproc-per-node "$N" \
          -m dsv3_rl.consistency.replay_check --layout "$L" --json "$OUT/replay_${N}gpu_${L//[=,]/_}.json"
      done
      step replay_4gpu_shift_must_fail 120 bash scripts/must_fail.sh 'replay check .*fault=shift: FAILED' torchrun --standalone \
        --nproc-per-node 4 -m dsv3_rl.consistency.replay_check --layout ep=4,etp=1 --fault shift
    }
    for S in $SPECS; do lane "corr-$S" corr4 "$S"; done
    lane replay replays
    lanes_wait
    ;;
  te-two)
    # the TE spec at every 2-process layout: fp32 (TF32 off by the suite) clean + swap-experts at each + the MLA
    # TP-grad fault at the TP ones + the patch-0001 twin; bf16 clean (faults are an fp32 matter: bf16 only sees
    # gross errors, docs/correctness.md); side by side
    S=${SPECS%% *}
    F=swap-experts,mla-tp-grad-patch-reverted
    [ "$S" = te ] && F=$F,mla-down-proj-patch-reverted
    corr2_fp32() {
      step "corr_2gpu_fp32_faults_spec-$S" 480 python -m dsv3_rl.correctness check-faults --spec "$S" --layout two \
        --each-layout --faults "$F" --json "$OUT/gpu2_fp32_faults_$S.json"
    }
    corr2_bf16() {
      step "corr_2gpu_bf16_spec-$S" 300 python -m dsv3_rl.correctness run --spec "$S" --layout two --dtype bf16 \
        --json "$OUT/gpu2_bf16_$S.json"
      # information, not a gate: patch 0001 reverted at tp2_sp (predicted PASS there: with SP the sequence gather's
      # reduce-scatter sums the rope-key gradient; docs/correctness.md), next to its twin at tp2_nosp_dense (FAIL)
      if [ "$S" = te ]; then
        step info_0001_reverted_tp2_sp_spec-te 150 bash -c "python -m dsv3_rl.correctness run --spec te --layout tp2_sp \
          --plant-fault mla-down-proj-patch-reverted --json $OUT/gpu2_0001_reverted_te.json; echo rc=\$?"
      fi
    }
    # TE_TWO_DTYPES="fp32" (or "bf16") runs one of the two lanes only
    for D in ${TE_TWO_DTYPES:-fp32 bf16}; do lane "$D" "corr2_$D"; done
    lanes_wait
    ;;
  replay)
    # 1 GPU: verl's router replay on the proxy model (record -> replay -> perturbed router); shifted must FAIL
    step replay_1gpu 150 python -m dsv3_rl.consistency.replay_check --model proxy --json "$OUT/replay_1gpu.json"
    step replay_1gpu_fp32 150 python -m dsv3_rl.consistency.replay_check --model proxy --dtype fp32 --json "$OUT/replay_1gpu_fp32.json"
    step replay_1gpu_shift_must_fail 150 bash scripts/must_fail.sh 'replay check .*fault=shift: FAILED' python -m dsv3_rl.consistency.replay_check \
      --model proxy --fault shift
    ;;
  te-checks)
    # TE facts only, no timing (runs beside other modes): the one-cuDNN check + megatron's TE pin, the MLA attention probe
    step te_env 90 python -m dsv3_rl.mcore.te_env
    step te_mla_attention 200 python -m dsv3_rl.mcore.te_attention_probe --json "$OUT/te_mla_attention.json"
    ;;
  refit)
    # verl is imported from backends/verl-*/verl without Ray (dsv3_rl/refit/verl_export.py); no TE, no vLLM
    step refit_bench 420 python bench/bench_refit.py --fp8 --manifest --json "$OUT/refit.json"
    ;;
  te)
    # Transformer Engine against the TE-free path, 4 GPUs side by side (~4 min after the TE install): the one-cuDNN
    # check + megatron's TE pin, the MLA attention probe (which backend TE picks for 192/128, thd/sbhd/bshd-padded,
    # each vs transformers' eager attention; the guard held to it), and bench_train_step: TE spec vs local spec vs
    # transformers on 1 GPU, TE vs local at TP2+SP and EP2 on 2 GPUs (lanes on distinct GPUs; the host is shared)
    # each takes the GPUs it runs on (CUDA_VISIBLE_DEVICES)
    te_checks() {
      step te_env 60 env CUDA_VISIBLE_DEVICES="$1" python -m dsv3_rl.mcore.te_env
      step te_mla_attention 280 env CUDA_VISIBLE_DEVICES="$1" python -m dsv3_rl.mcore.te_attention_probe \
        --json "$OUT/te_mla_attention.json"
    }
    te_bench1() {
      step bench_1gpu_te_local 280 env CUDA_VISIBLE_DEVICES="$1" python bench/bench_train_step.py --spec te,local \
        --json "$OUT/bench-1gpu-te-local.json"
    }
    te_bench2() {
      step bench_2gpu_te_local 280 env CUDA_VISIBLE_DEVICES="$1" torchrun --standalone --nproc-per-node 2 \
        bench/bench_train_step.py --engines mcore --spec te,local --layout tp=2,etp=1 --layout ep=2,etp=1 \
        --json "$OUT/bench-2gpu-te-local.json"
    }
    # TE_CHECKS=0 skips the cuDNN check and the MLA probe (measured before: results/2026-11-26-gpu)
    if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then  # side by side on distinct GPUs
      [ "${TE_CHECKS:-1}" = 1 ] && lane te-checks te_checks 3
      lane te-bench1 te_bench1 0
      lane te-bench2 te_bench2 1,2
      lanes_wait
    else  # 2 GPUs: one after the other
      [ "${TE_CHECKS:-1}" = 1 ] && te_checks 0
      te_bench1 0
      te_bench2 0,1
    fi
    for f in te_env te_mla_attention bench_1gpu_te_local bench_2gpu_te_local; do  # each step's one-line result (errors: above)
      grep -h -E "^(Transformer Engine|cuDNN|MLA fused|te_mla_attention:|bench_train_step:)" "$OUT/$f.log" 2>/dev/null \
        | sed "s/^/    [$f] /"
    done
    ;;
  *) echo "usage: $0 fastpath|correctness|memory|two-gpu|four-gpu|te-two|te|te-checks|refit|replay" >&2; exit 2 ;;
esac
echo "=== summary"; printf '%s\n' "${SUMMARY[@]}"
