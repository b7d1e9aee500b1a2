#!/usr/bin/env bash
# PAI-DLC: write the job spec for a preset and print the `dlc submit` command. Every pod runs
# run_mcore_deepseek_verl.sh with the same preset; the launcher reads DLC's environment (RANK, WORLD_SIZE,
# MASTER_ADDR, KUBERNETES_CONTAINER_RESOURCE_GPU / MLP_WORKER_*), makes pod 0 the Ray head, and the rest join.
#
#   DLC_IMAGE=<image> DLC_WORKSPACE_ID=<ws> DLC_RESOURCE_ID=<quota> DLC_DATA_SOURCES=<ds-id> \
#   WORK_DIR=/mnt/data/dsv3 bash examples/deepseek_v3/dlc/submit_dlc.sh 671b_512xH100 [verl overrides ...]
#
# Writes $WORK_DIR/dlc/<preset>.job (for `dlc submit pytorchjob --job_file=...`) and <preset>.json (CreateJob
# request body); set SUBMIT=1 to run `dlc submit` as well.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PRESET=${1:?usage: submit_dlc.sh PRESET [verl overrides ...]}; shift
OUT=${OUT:-${WORK_DIR:-$REPO/runs}/dlc}
PYTHON=${PYTHON:-python}
if [[ -z "${VIRTUAL_ENV:-}" && -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; fi
mkdir -p "$OUT"
cd "$REPO"
"$PYTHON" -m dsv3_rl.launch dlc --preset "$PRESET" --format job_file --out "$OUT/$PRESET.job" "$@"
"$PYTHON" -m dsv3_rl.launch dlc --preset "$PRESET" --format json --out "$OUT/$PRESET.json" "$@"
echo "submit with:  dlc submit pytorchjob --job_file=$OUT/$PRESET.job"
if [[ "${SUBMIT:-0}" == 1 ]]; then dlc submit pytorchjob --job_file="$OUT/$PRESET.job"; fi
