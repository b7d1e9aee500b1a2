#!/bin/bash
# usage: run1.sh NAME PRESET [ENV=VAL ...]  -> wall, machine CPU-s, startup line
name=$1; preset=$2; shift 2
cd /work/main
cpu() { awk '/^cpu /{print ($2+$3+$4+$7+$8)/100}' /proc/stat; }
c0=$(cpu); t0=$(date +%s.%N)
env "$@" WORK_DIR=/tmp/s6/exp/work-$name CKPT_DIR=/tmp/s6/exp/$name/ckpt LOG_DIR=/tmp/s6/exp/$name/logs \
  bash examples/deepseek_v3/run_mcore_deepseek_verl.sh --preset $preset --quiet > /tmp/s6/exp/$name.out 2>&1
rc=$?
t1=$(date +%s.%N); c1=$(cpu)
echo "$name rc=$rc wall=$(echo "$t1-$t0"|bc) cpu=$(echo "$c1-$c0"|bc)"
grep -E "start-up|s/step|PASSED|FAILED|finished in" /tmp/s6/exp/$name.out | cut -c1-250
