#!/bin/bash
cd /work/main
cpu() { awk '/^cpu /{print ($2+$3+$4+$7+$8)/100}' /proc/stat; }
idle() { awk '/^cpu /{print ($5+$6)/100}' /proc/stat; }
export TORCHDYNAMO_DISABLE=1 PYTHONUNBUFFERED=1 DSV3_DEMO_DIR=/tmp/ci-clone/out/grpo-demo
for stage in e2e backends; do
  c0=$(cpu); i0=$(idle); t0=$(date +%s)
  if [ $stage = e2e ]; then .venv/bin/python -m pytest tests/unit -q --durations=15 -m e2e -p no:cacheprovider > /tmp/s6/floor/e2e.log 2>&1; rc=$?
  else make test-backends > /tmp/s6/floor/backends.log 2>&1; rc=$?; fi
  t1=$(date +%s); c1=$(cpu); i1=$(idle)
  echo "$stage rc=$rc wall=$((t1-t0)) cpu=$(echo "$c1-$c0"|bc) idle=$(echo "$i1-$i0"|bc)"
done
