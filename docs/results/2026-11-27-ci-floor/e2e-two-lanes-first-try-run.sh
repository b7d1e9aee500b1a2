#!/bin/bash
cd /work/main
cpu() { awk '/^cpu /{print ($2+$3+$4+$7+$8)/100}' /proc/stat; }
idle() { awk '/^cpu /{print ($5+$6)/100}' /proc/stat; }
export TORCHDYNAMO_DISABLE=1 PYTHONUNBUFFERED=1 DSV3_DEMO_DIR=/tmp/ci-clone/out/grpo-demo
( while true; do free -m | awk '/^Mem:/{print $3, $7}'; sleep 5; done ) > /tmp/s6/cc/mem.txt &
mp=$!
c0=$(cpu); i0=$(idle); t0=$(date +%s)
.venv/bin/python -m pytest tests/unit/test_launch_faults.py tests/unit/test_grpo_learning.py -q --durations=15 -m e2e -p no:cacheprovider \
  --basetemp=/tmp/s6/cc/bt1 -k "not stale_rollout_weights and not constant_reward" > /tmp/s6/cc/p1.log 2>&1 &
p1=$!
.venv/bin/python -m pytest tests/unit/test_algorithm_demos.py tests/unit/test_grpo_learning.py -q --durations=15 -m e2e -p no:cacheprovider \
  --basetemp=/tmp/s6/cc/bt2 -k "algorithm_demo or stale_rollout_weights or constant_reward" > /tmp/s6/cc/p2.log 2>&1 &
p2=$!
wait $p1; r1=$?; t1=$(date +%s)
wait $p2; r2=$?; t2=$(date +%s)
c1=$(cpu); i1=$(idle)
kill $mp
echo "p1 rc=$r1 ends at $((t1-t0)) s; p2 rc=$r2 ends at $((t2-t0)) s; cpu=$(echo "$c1-$c0"|bc) idle=$(echo "$i1-$i0"|bc); max used MiB $(sort -n /tmp/s6/cc/mem.txt | tail -1)"
