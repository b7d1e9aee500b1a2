#!/usr/bin/env bash
# DeepSeek-V3 GRPO with verl (megatron strategy, vLLM rollout, our math reward), checkpoint to training:
# FP8 cast + config fix-up -> HF->mcore -> data -> verl main_ppo. Each stage is skipped when its verified
# output exists. Everything else is in Python (dsv3_rl/launch) and in the preset files (presets/).
#
#   bash examples/deepseek_v3/run_mcore_deepseek_verl.sh --preset 671b_512xH100 --dry-run
#   PRESET=proxy_8xH100 bash examples/deepseek_v3/run_mcore_deepseek_verl.sh data.train_batch_size=128
#   bash examples/deepseek_v3/run_mcore_deepseek_verl.sh --list
#
# Any other argument is a verl/Hydra override, passed through. On PAI-DLC or under Slurm, run the same
# command on every node: node 0 becomes the Ray head and runs the job, the others join it.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

export PRESET=${PRESET:-tiny_cpu}                     # presets/<name>.yaml (model x hardware)
export WORK_DIR=${WORK_DIR:-$REPO/runs}               # models/, dataset/, data/, ckpt/, logs/ below it
export MODEL_PATH=${MODEL_PATH:-}                     # HF checkpoint as downloaded (default WORK_DIR/models/<name>)
export HF_PATH=${HF_PATH:-}                           # BF16 checkpoint (default MODEL_PATH, or MODEL_PATH-BF16 for FP8)
export MCORE_PATH=${MCORE_PATH:-}                     # megatron dist checkpoint (default WORK_DIR/models/<HF>-mcore)
export DATA_RAW=${DATA_RAW:-}                         # dataset as downloaded (default WORK_DIR/dataset/MATH-lighteval)
export DATA_DIR=${DATA_DIR:-}                         # verl parquet (default WORK_DIR/data/<dataset>)
export CKPT_DIR=${CKPT_DIR:-}                         # trainer checkpoints, resumed automatically
export LOG_DIR=${LOG_DIR:-}                           # tensorboard/ and wandb (offline) below it
export DRY_RUN=${DRY_RUN:-0}                          # 1: resolve and validate, start nothing

PYTHON=${PYTHON:-python}
if [[ -z "${VIRTUAL_ENV:-}" && -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; fi

cd "$REPO"
exec "$PYTHON" -m dsv3_rl.launch run "$@"
