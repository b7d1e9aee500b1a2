#!/usr/bin/env bash
# two launcher processes on loopback: node 0 (ray head, stages, submits main_ppo) and node 1 (ray worker)
set -u
cd /work/main
T=/tmp/tn
port=$(.venv/bin/python -c "from dsv3_rl.ports import free_port; print(free_port())")
W0=$T/n0/work; W1=$T/n1/work
common=(DSV3_PLATFORM=dlc MASTER_ADDR=127.0.0.1 WORLD_SIZE=2 KUBERNETES_CONTAINER_RESOURCE_GPU=1 RAY_PORT=$port
        MCORE_PATH=$W0/models/dsv3-tiny-warm-mcore DATA_DIR=$W0/data/math_lighteval PYTHON=/work/main/.venv/bin/python)
args=(--preset $T/tiny_cpu_twonode.yaml trainer.nnodes=2 trainer.n_gpus_per_node=1 trainer.total_training_steps=3)
echo "ray port $port; $(date -u)"
env "${common[@]}" RANK=0 RAY_TMPDIR=$T/r0 WORK_DIR=$W0 bash examples/deepseek_v3/run_mcore_deepseek_verl.sh "${args[@]}" > $T/node0.log 2>&1 &
p0=$!
sleep 5
env "${common[@]}" RANK=1 RAY_TMPDIR=$T/r1 WORK_DIR=$W1 bash examples/deepseek_v3/run_mcore_deepseek_verl.sh "${args[@]}" > $T/node1.log 2>&1 &
p1=$!
echo "node0 pid $p0, node1 pid $p1"
wait $p0; echo "node0 exit $?" | tee $T/rc0
wait $p1; echo "node1 exit $?" | tee $T/rc1
date -u
