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
# The offline environment of scripts/gpu-box.lock (vLLM, Ray, verl's engine dependencies, pydantic, transformers,
# the math reward; Transformer Engine apart), installed once per box by `bash scripts/gpu_box.sh install`
# (docs/gpu-setup.md): first on the path. Its TE goes on the path only with DSV3_GPU_TE=1.
GPUBOX=${DSV3_GPUBOX:-/root/dsv3-env}
if [ -f "$GPUBOX/DONE.json" ]; then
  SITE="$GPUBOX/site${SITE:+:$SITE}"
  case ":$PATH:" in *":$GPUBOX/site/bin:"*) ;; *) export PATH="$GPUBOX/site/bin:$PATH" ;; esac  # `ray` (multi-node)
  if [ "${DSV3_GPU_TE:-0}" = 1 ]; then
    SITE="$GPUBOX/te:$SITE"
    # TE's NVRTC kernels need cuda_runtime.h at run time (it looks in /usr/local/cuda)
    if [ ! -f /usr/local/cuda/include/cuda_runtime.h ] && [ -z "${NVTE_CUDA_INCLUDE_DIR:-}" ]; then
      NVTE_CUDA_INCLUDE_DIR="$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/nvidia/cu13/include"
      export NVTE_CUDA_INCLUDE_DIR
    fi
  fi
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
