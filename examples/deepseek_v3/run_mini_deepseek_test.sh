#!/usr/bin/env bash
# MLA/MoE correctness of megatron-core against HuggingFace at one parallel layout (seed-compatible).
#
#   bash examples/deepseek_v3/run_mini_deepseek_test.sh ENV TP PP [EP ETP] [extra test_mla_moe_correctness.py args]
#
# ENV: cpu  gloo on CPU processes (CUDA hidden)
#      dsw  the GPUs of this machine (NCCL), e.g. a PAI-DSW dev box
#      dlc  the GPUs of this node (NCCL), e.g. inside a PAI-DLC job (single node; the job's
#           MASTER_ADDR/RANK are not used: the test starts its own processes)
# Processes: TP*PP (or EP*ETP*PP if larger). Environment (defaults):
#   HF_MODEL_PATH   HF DeepSeek-V3 checkpoint; unset: a random mini model of PRESET is written to
#                   $WORK/mini-$PRESET first (kept, reused by the next run)
#   PRESET=tiny  DTYPE=fp32  BATCH=4  SEQ=64  MBS=1  WORK=outputs/mini_deepseek_test  PYTHON=python
# Exit status 1 when any check FAILs. The report is explained in docs/correctness.md.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 3 ] || usage
ENV_KIND=$1 TP=$2 PP=$3
shift 3
EP=1 ETP=1
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then EP=$1; shift; fi
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then ETP=$1; shift; fi

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
PRESET=${PRESET:-tiny}
DTYPE=${DTYPE:-fp32}
BATCH=${BATCH:-4}
SEQ=${SEQ:-64}
MBS=${MBS:-1}
WORK=${WORK:-outputs/mini_deepseek_test}
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}

case "$ENV_KIND" in
  cpu) export CUDA_VISIBLE_DEVICES="" ;;
  dsw|dlc) unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK 2>/dev/null || true ;;
  *) echo "error: ENV must be cpu, dsw or dlc (got '$ENV_KIND')" >&2; exit 2 ;;
esac

if [ -z "${HF_MODEL_PATH:-}" ]; then
  HF_MODEL_PATH=$WORK/mini-$PRESET-$DTYPE
  if [ ! -f "$HF_MODEL_PATH/config.json" ]; then
    echo "Creating a random $PRESET DeepSeek-V3 model in $HF_MODEL_PATH ..."
    mkdir -p "$WORK"
    "$PYTHON" -m dsv3_rl.minimodel.mini_model --model "$PRESET" --out "$HF_MODEL_PATH" --dtype "$DTYPE"
  fi
fi

echo "===== 测试 TP=$TP, PP=$PP, EP=$EP, ETP=$ETP 配置 ($ENV_KIND) ====="
exec "$PYTHON" examples/deepseek_v3/test_mla_moe_correctness.py \
  --hf-model-path "$HF_MODEL_PATH" --test-tp "$TP" --test-pp "$PP" --test-ep "$EP" --test-etp "$ETP" \
  --test-batch-size "$BATCH" --test-seq-length "$SEQ" --micro-batch-size "$MBS" --dtype "$DTYPE" "$@"
