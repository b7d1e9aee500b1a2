#!/usr/bin/env bash
# DeepSeek-V3 HF <-> megatron-core distributed checkpoint, with Pai-Megatron-Patch's argument order:
#
#   bash run_32xH20.sh MODEL_SIZE LOAD_DIR SAVE_DIR MG2HF USE_CUDA PR [HF_DIR]
#
#   MODEL_SIZE  A37B (DeepSeek-V3 671B; checked against LOAD_DIR's config) or auto (read the config)
#   MG2HF       false: HF -> mcore (LOAD_DIR is the HF model); true: mcore -> HF (HF_DIR gives
#               config/tokenizer; default: the copy stored in the mcore checkpoint by hf->mcore)
#   USE_CUDA    accepted for compatibility; the conversion is I/O-bound and runs on CPU (gloo) either way
#   PR          bf16 | fp16 | fp32: dtype of the written checkpoint
#
# Ranks come from the environment (default 1): NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT (torchrun's; PAI-DLC/Slurm launchers set them). SAVE_DIR must be on a filesystem every
# node sees. Extra flags for python -m dsv3_rl.convert go in CONVERT_ARGS (e.g. "--keep-mtp").
# DRY_RUN=1 validates the config and prints the mapping and the command without converting.
# PYTHON: the interpreter (default: the project's .venv when no virtualenv is active).
set -euo pipefail

if [ $# -lt 6 ]; then
    sed -n '2,17p' "$0" >&2
    exit 2
fi
MODEL_SIZE=$1 LOAD_DIR=$2 SAVE_DIR=$3 MG2HF=$4 USE_CUDA=$5 PR=$6 HF_DIR=${7:-}

case "$PR" in bf16|fp16|fp32) ;; *) echo "error: PR=$PR; allowed: bf16, fp16, fp32" >&2; exit 2 ;; esac
case "$USE_CUDA" in true|false) ;; *) echo "error: USE_CUDA=$USE_CUDA; allowed: true, false" >&2; exit 2 ;; esac
case "$MG2HF" in
    false) ARGS=(hf-to-mcore --hf-dir "$LOAD_DIR" --out "$SAVE_DIR") ; CFG_DIR=$LOAD_DIR ;;
    true)  ARGS=(mcore-to-hf --mcore-dir "$LOAD_DIR" --out "$SAVE_DIR") ; CFG_DIR=${HF_DIR:-$LOAD_DIR/hf_meta}
           if [ -n "$HF_DIR" ]; then ARGS+=(--hf-dir "$HF_DIR"); fi ;;
    *) echo "error: MG2HF=$MG2HF; allowed: true (mcore -> HF), false (HF -> mcore)" >&2; exit 2 ;;
esac
ARGS+=(--dtype "$PR" --model-size "$MODEL_SIZE")
# shellcheck disable=SC2206
ARGS+=(${CONVERT_ARGS:-})

# $PYTHON if set; else the active virtualenv's python; else the project's .venv (make setup), so the
# script works from a fresh shell; else python on PATH.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../../.." && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ -z "${VIRTUAL_ENV:-}" ] && [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python; fi
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
NNODES=${NNODES:-1}
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

if [ "${DRY_RUN:-0}" = 1 ]; then
    "$PYTHON" -m dsv3_rl.convert plan --hf-dir "$CFG_DIR" --model-size "$MODEL_SIZE"
    echo "would run: $PYTHON -m dsv3_rl.convert ${ARGS[*]} on $((NPROC_PER_NODE * NNODES)) rank(s)"
    exit 0
fi
if [ "$((NPROC_PER_NODE * NNODES))" -gt 1 ]; then
    exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES" \
        --node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29511}" \
        -m dsv3_rl.convert "${ARGS[@]}"
fi
exec "$PYTHON" -m dsv3_rl.convert "${ARGS[@]}"
