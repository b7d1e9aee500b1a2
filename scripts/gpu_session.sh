#!/usr/bin/env bash
# The GPU checks of this repo, in stages that each fit in ~10 minutes on one GPU box, with every
# result written under $OUT (default out/gpu). No Transformer Engine, no vLLM needed: the patched
# megatron-core tree is put on PYTHONPATH.
#
#   bash scripts/gpu_session.sh fastpath     # 1 GPU: TE-free fast-path bench + GPU unit tests + fp8 cast bench
#   bash scripts/gpu_session.sh correctness  # 1 GPU: fast-path GPU tests, correctness tp1 fp32, planted faults, bf16 proxy
#   bash scripts/gpu_session.sh memory       # 1 GPU: planner vs measured peak memory (gpu + gpu-act sets, ~1 min)
#   bash scripts/gpu_session.sh two-gpu      # 2 GPUs: correctness layouts over NCCL, faults, planner memory, TP2/EP2 bench
#   bash scripts/gpu_session.sh refit        # 1 GPU: refit export bench (BF16, checksum manifest, FP8 + quantize kernel)
#   bash scripts/gpu_session.sh replay       # 1 GPU: router replay record/replay check on the proxy model (+ shifted fault)
#
# Each step has its own time limit; a failing step is reported and the next one still runs.
# Ends with one line per step: name, status, seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
# Wheels carried in .whl/ go first on the path. The package imports pydantic (preset and backends.lock
# schemas; tests/conftest.py reaches it through dsv3_rl.launch), which the box lacks: fetch it once with
#   pip download --dest .whl --only-binary :all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 pydantic && rm .whl/typing_extensions-*
# and carry .whl (about 3 MB). Optional: transformers 5.10.4 + tokenizers 0.22.2 (the versions verl 0.9.1
# accepts and the CPU suite uses, instead of the box's newer transformers).
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && SITE=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/backends/megatron-core-0.16.1${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
SUMMARY=()

step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc=0
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1 || rc=$?
  local st=ok; [ "$rc" -eq 0 ] || st="FAIL(rc=$rc)"; [ "$rc" -eq 124 ] && st="TIMEOUT"
  SUMMARY+=("$name $st $((SECONDS - t0))s")
  echo "=== $name: $st in $((SECONDS - t0))s"
}

nvidia-smi -L; python -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, 'mcore', m.__version__)"

case "${1:-}" in
  fastpath)
    step bench_1gpu 280 python bench/bench_train_step.py --grouped auto,off --json "$OUT/bench-1gpu.json"
    step gpu_unit 130 python -m pytest -q -m gpu tests/gpu/test_fp8_cast_gpu.py tests/gpu/test_mcore_fastpath_gpu.py -p no:cacheprovider
    step fp8_bench 140 env -u TORCHDYNAMO_DISABLE python bench/bench_fp8_cast.py --set num_hidden_layers=2 \
      --workdir /tmp/fp8bench --json "$OUT/fp8.json"
    ;;
  correctness)
    step fastpath_unit 170 python -m pytest -q -s -m gpu tests/gpu/test_mcore_fastpath_gpu.py -p no:cacheprovider
    step corr_tp1 100 python -m dsv3_rl.correctness run --layout tp1 --json "$OUT/gpu1_fp32.json"
    step corr_faults 100 python -m dsv3_rl.correctness check-faults \
      --faults swap-experts,router-bias,yarn-mscale,no-group-routing,rope-interleave-false,rope-interleave-false-unchecked \
      --json "$OUT/gpu1_faults.json"
    step corr_proxy_bf16 300 python -m dsv3_rl.correctness run --layout tp1 --model proxy --set num_hidden_layers=2 \
      --dtype bf16 --batch-size 2 --seq-length 256 --calibrate --work /tmp/proxy --json "$OUT/gpu1_bf16_proxy.json"
    ;;
  memory)
    step planner_mem 200 python bench/measure_train_memory.py --out "$OUT/measured_gpu.jsonl"
    step planner_mem_act 150 python bench/measure_train_memory.py --set gpu-act --out "$OUT/measured_gpu_act.jsonl"
    ;;
  two-gpu)
    step corr_2gpu 200 python -m dsv3_rl.correctness run \
      --layout dp2,tp2_sp,pp2,pp2_vpp2,pp2_vpp2_batchp2p,ep2,ep2_allgather,tp2_ep2,tp2_etp2,etp2,tp2_nosp \
      --json "$OUT/gpu2_fp32.json"
    step corr_2gpu_fault 90 python -m dsv3_rl.correctness check-faults --layout tp2_sp \
      --faults mla-tp-grad-patch-reverted --json "$OUT/gpu2_faults.json"
    step planner_mem 150 python bench/measure_train_memory.py --out "$OUT/measured_gpu.jsonl"
    step bench_2gpu 130 torchrun --nproc-per-node 2 bench/bench_train_step.py --layout tp=2,etp=1 --layout ep=2,etp=1 --json "$OUT/bench-2gpu.json"
    # router replay over NCCL: record, replay (agreement 1.0, same loss), hold under a perturbed router; shifted must FAIL
    for L in tp=2,sp=true ep=2,etp=1 tp=2,ep=2,etp=1 pp=2; do
      step "replay_${L//[=,]/_}" 120 torchrun --nproc-per-node 2 -m dsv3_rl.consistency.replay_check --model proxy \
        --layout "$L" --json "$OUT/replay_2gpu_${L//[=,]/_}.json"
    done
    step replay_2gpu_shift_must_fail 120 bash -c '! torchrun --nproc-per-node 2 -m dsv3_rl.consistency.replay_check \
      --model proxy --layout tp=2,ep=2,etp=1 --fault shift'
    ;;
  replay)
    # 1 GPU: verl's router replay on the proxy model (record -> replay -> perturbed router); shifted must FAIL
    step replay_1gpu 150 python -m dsv3_rl.consistency.replay_check --model proxy --json "$OUT/replay_1gpu.json"
    step replay_1gpu_fp32 150 python -m dsv3_rl.consistency.replay_check --model proxy --dtype fp32 --json "$OUT/replay_1gpu_fp32.json"
    step replay_1gpu_shift_must_fail 150 bash -c '! python -m dsv3_rl.consistency.replay_check --model proxy --fault shift'
    ;;
  refit)
    # verl is imported from backends/verl-*/verl without Ray (dsv3_rl/refit/verl_export.py); no TE, no vLLM
    step refit_bench 420 python bench/bench_refit.py --fp8 --manifest --json "$OUT/refit.json"
    ;;
  *) echo "usage: $0 fastpath|correctness|memory|two-gpu|refit|replay" >&2; exit 2 ;;
esac
echo "=== summary"; printf '%s\n' "${SUMMARY[@]}"
