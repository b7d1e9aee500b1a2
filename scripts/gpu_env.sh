# Sourced by the GPU-box scripts (scripts/gpu_session.sh, scripts/grpo_update_vs_planner.sh): the environment
# every GPU step runs in.
# Wheels carried in .whl/ go first on the path. The package imports pydantic (preset and backends.lock
# schemas; tests/conftest.py reaches it through dsv3_rl.launch), which the box lacks: fetch it once with
#   pip download --dest .whl --only-binary :all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 pydantic && rm .whl/typing_extensions-*
# and carry .whl (about 3 MB; the GRPO update bench needs more: docs/planner.md). Optional: transformers 5.10.4 +
# tokenizers 0.22.2 (the versions verl 0.9.1 accepts and the CPU suite uses, instead of the box's newer transformers).
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
  # once per box: a second session started beside a running one must not rewrite the packages it imports
  if [ -f /tmp/site/.dsv3-whl-done ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.dsv3-whl-done; }; then SITE=/tmp/site; fi
fi
# backends/ is git-ignored: the device tool sends it only when carried. Without it every step would die on
# "No module named 'megatron'" (and a must-fail twin would pass on that), so stop here, in one line.
for b in backends/megatron-core-0.16.1/megatron backends/verl-0.9.1/verl; do
  [ -d "$b" ] || { echo "error: $b is not in this working tree: carry it (backends/ is git-ignored; run 'make backends apply-patches' first)" >&2; exit 2; }
done
# verl's source tree too: the bench imports it through dsv3_rl.refit.verl_export, and `dsv3-plan validate` (the
# planner's dynamic-batch model uses verl's own seqlen balancing) imports it directly
export PYTHONPATH="$PWD:$PWD/backends/megatron-core-0.16.1:$PWD/backends/verl-0.9.1${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1} PYTHONUNBUFFERED=1
# NVLink multicast stays off (NCCL NVLS, torch symmetric memory, NVSHMEM): the lent boxes do not support it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
