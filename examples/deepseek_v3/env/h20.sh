# H20-96GB (8 per node) on PAI Lingjun / RoCE clusters. Values are defaults: set the variable in the
# job to override.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# A named interface that this host does not have is not set: NCCL and Gloo then pick one themselves (a single-node
# box without eth0 would otherwise fail Gloo's "Unable to find address for: eth0" in every worker).
_dsv3_if=${NCCL_SOCKET_IFNAME:-${MLP_SOCKET_IFNAME:-eth0}}
if [ -n "${NCCL_SOCKET_IFNAME:-}" ] || [ -e "/sys/class/net/${_dsv3_if%%,*}" ]; then
  export NCCL_SOCKET_IFNAME=$_dsv3_if
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-${NCCL_SOCKET_IFNAME}}
fi
unset _dsv3_if
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
# RoCE: GID index 3 (RoCE v2), traffic class 136 and service level 5 = the lossless (PFC) queue that
# Lingjun clusters reserve for RDMA; without them RDMA traffic shares the lossy queue.
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}
export NCCL_IB_TC=${NCCL_IB_TC:-136}
export NCCL_IB_SL=${NCCL_IB_SL:-5}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}
export NCCL_IB_QPS_PER_CONNECTION=${NCCL_IB_QPS_PER_CONNECTION:-8}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-1800}
