# H100 (SXM5, 8 per node, NVLink/NVSwitch inside the node, InfiniBand or RoCE between nodes).
# Values are defaults: set the variable in the job to override (e.g. NCCL_IB_HCA for your NICs).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Interface for NCCL's bootstrap and for Gloo (verl and Megatron create Gloo groups too). PAI-DLC and
# Volcengine-style platforms name it in MLP_SOCKET_IFNAME; otherwise eth0 (bond0 on many bare-metal IB hosts).
# A named interface that this host does not have is not set: NCCL and Gloo then pick one themselves (a single-node
# box without eth0 would otherwise fail Gloo's "Unable to find address for: eth0" in every worker).
_dsv3_if=${NCCL_SOCKET_IFNAME:-${MLP_SOCKET_IFNAME:-eth0}}
if [ -n "${NCCL_SOCKET_IFNAME:-}" ] || [ -e "/sys/class/net/${_dsv3_if%%,*}" ]; then
  export NCCL_SOCKET_IFNAME=$_dsv3_if
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-${NCCL_SOCKET_IFNAME}}
fi
unset _dsv3_if
# RDMA NICs: all mlx5 ports (prefix match). Restrict to the compute rail NICs if the host has others.
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
# RoCE v2 needs GID index 3 on most clouds; plain InfiniBand ignores it.
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}
# Longer IB timeout / more retries: 64-node all-to-all (MoE EP) under load otherwise trips "ibv_poll_cq error 12".
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}
# More QPs per connection spread EP all-to-all traffic over the fabric's paths.
export NCCL_IB_QPS_PER_CONNECTION=${NCCL_IB_QPS_PER_CONNECTION:-8}
# GPUDirect RDMA as far as the PCIe switch allows.
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
# Errors and warnings only (INFO prints per-communicator topology: thousands of lines at 512 GPUs).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Fail a hung collective instead of waiting forever (seconds; torch's NCCL watchdog).
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-1800}
