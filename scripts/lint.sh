#!/usr/bin/env bash
# The lint and type gate: ruff and mypy --strict (settings in pyproject.toml) over the paths
# below; any error fails it. scripts/test.sh runs it before pytest, so CI does too.
#
# The gate's scope, in one place: ruff checks the whole repository; mypy --strict checks
# CHECKED (all of broker/, spark_beanstalk/, beanstalk_rules/ and pyspark_beanstalk/ among them);
# `bash scripts/lint.sh --all` runs mypy without --follow-imports=silent, for clean-ups.
set -euo pipefail
cd "$(dirname "$0")/.."

# Checked by mypy --strict.
CHECKED=(
  beanstalk_rules
  broker
  spark_beanstalk
  pyspark_beanstalk
  jobs/_common.py
  tests/faultfs.py
  tests/helpers.py
  tests/test_helpers.py
  tests/test_rules.py
)
# ruff covers the whole repository (tests, jobs and benchmarks included).
RUFF_PATHS=(.)
MYPY_PATHS=("${CHECKED[@]}")
# Imported modules outside MYPY_PATHS are still analysed (their types are used), but their
# own errors are not reported until they join the list. Drop this once the lists cover all.
MYPY_FLAGS=(--follow-imports=silent)

if [ "${1:-}" = "--all" ]; then
  RUFF_PATHS=(.)
  MYPY_PATHS=(broker spark_beanstalk beanstalk_rules pyspark_beanstalk)
  MYPY_FLAGS=()
fi

status=0
echo "ruff check: ${RUFF_PATHS[*]}"
python3 -m ruff check --no-cache "${RUFF_PATHS[@]}" || status=1
echo "mypy --strict: ${MYPY_PATHS[*]}"
python3 -m mypy "${MYPY_FLAGS[@]}" "${MYPY_PATHS[@]}" || status=1
if [ "$status" != 0 ]; then
  echo "lint gate FAILED (see above)" >&2
fi
exit "$status"
