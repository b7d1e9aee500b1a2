# Environment shared by every preset. Sourced by the hardware files below (bash, `set -a`), so each
# value is a default: anything already set in the job's environment wins.

# Megatron with TP/CP communication overlap on Hopper/Ampere needs kernels launched in order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# NVLink SHARP (NVLS) off: verl's DeepSeek-V3 recipes require it (NCCL errors / hangs with it on when
# vLLM and Megatron communicators share GPUs).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# vLLM's V1 engine (the only one in current vLLM; explicit for older images).
export VLLM_USE_V1=${VLLM_USE_V1:-1}
# Fewer allocator surprises when vLLM sleeps/wakes next to the trainer.
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
# Tokenizers fork inside Ray workers.
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
# Full Hydra tracebacks and unbuffered logs (they go through Ray).
export HYDRA_FULL_ERROR=${HYDRA_FULL_ERROR:-1}
export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}
# Ray: keep every worker's log line (deduplication hides rank-specific errors); no usage reporting.
export RAY_DEDUP_LOGS=${RAY_DEDUP_LOGS:-0}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
# Ray: how long ray.init() waits for its node's raylet to register (Ray's default 30 s, read by the driver's
# GlobalStateAccessor). The raylet registers only after its dashboard and runtime-env agents (Python processes) have
# written their port files; on a loaded 2-core CI box that took > 30 s about once per CI run and failed the start
# ("The current node timed out during startup", a retry costing ~300 s; docs/ci-history.md "2026-12-07").
export RAY_raylet_start_wait_time_s=${RAY_raylet_start_wait_time_s:-120}
