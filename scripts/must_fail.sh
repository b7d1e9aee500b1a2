#!/usr/bin/env bash
# must_fail.sh REGEX CMD...: a planted-fault twin passes only when CMD fails AND prints a line matching REGEX
# (the check's own FAILED line), so a crash, a missing module or a refused flag is not mistaken for a caught
# fault (scripts/gpu_session.sh; on 2026-11-26 a twin "passed" on "No module named 'megatron'").
set -uo pipefail
re=$1; shift
log=$(mktemp); rc=0
"$@" > "$log" 2>&1 || rc=$?
cat "$log"
if [ "$rc" -eq 0 ]; then echo "must_fail: the planted fault was NOT caught (exit 0)"; rm -f "$log"; exit 1; fi
if ! grep -Eq "$re" "$log"; then echo "must_fail: exit $rc but no line matches /$re/: it failed for another reason"; rm -f "$log"; exit 1; fi
echo "must_fail: caught as expected (exit $rc, /$re/)"; rm -f "$log"
