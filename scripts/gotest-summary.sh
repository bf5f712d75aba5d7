#!/usr/bin/env bash
# Passes `go test -v` output through and ends with one count line, the
# plain "N passed, N failed, N skipped" that CI reads. Exits non-zero when
# a test failed or the run itself did (build error, panic, timeout).
set -uo pipefail
pass=0 fail=0 skip=0 broken=0
while IFS= read -r line; do
  printf '%s\n' "$line"
  case "$line" in
    *"--- PASS: "*) pass=$((pass + 1)) ;;
    *"--- FAIL: "*) fail=$((fail + 1)) ;;
    *"--- SKIP: "*) skip=$((skip + 1)) ;;
    FAIL*|panic:*) broken=1 ;;
  esac
done
echo "${pass} passed, ${fail} failed, ${skip} skipped"
((fail == 0 && broken == 0))
