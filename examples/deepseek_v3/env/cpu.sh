# CPU runs (gloo): no NCCL. Gloo binds to loopback so a laptop or CI box needs no network setup.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
# One thread per process keeps N worker processes from oversubscribing a small box.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
# vLLM's CPU backend: KV cache size in GiB.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
