# CPU runs (gloo): no NCCL. Gloo binds to loopback so a laptop or CI box needs no network setup.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
# One thread per process keeps N worker processes from oversubscribing a small box.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
# vLLM's CPU backend sizes its KV cache from rollout.engine_kwargs.vllm.kv_cache_memory_bytes (the CPU
# presets set it); VLLM_CPU_KVCACHE_SPACE (whole GiB), when set, overrides that.
# verl's CPU platform (gloo, CPU Ray slots, shared-memory weight sync, no vLLM sleep mode; patches 0010-0016).
export VERL_PLATFORM=${VERL_PLATFORM:-cpu}
# vLLM's CPU build: do not pin its OpenMP threads (the trainers run on the same cores).
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu}
# With 0, vLLM's CPU platform keeps the one-process executor ("uni") that the launcher asks for at rollout tp 1
# (each engine's model runs in its EngineCore process: no worker process beside it); with 1 it turns "uni" into
# "mp". The engine core still runs in a process of its own (verl's server uses vLLM's AsyncLLM).
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
# TransferQueue (verl's data plane) sets torch's threads to this around each transfer (default 8, capped at
# the physical cores with one warning per transfer: thousands of log lines on a 2-core box).
export TQ_NUM_THREADS=${TQ_NUM_THREADS:-1}
# glibc: at most 2 malloc arenas per process. The ~40 processes of a CPU run (Ray, vLLM, Megatron, TransferQueue)
# are multi-threaded; per-thread arenas let their resident memory creep up step after step.
export MALLOC_ARENA_MAX=${MALLOC_ARENA_MAX:-2}
