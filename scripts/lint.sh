#!/usr/bin/env bash
# The lint and type gate: ruff and mypy --strict (settings in pyproject.toml) over the paths
# below; any error fails it. scripts/test.sh runs it before pytest, so CI does too.
#
# The two lists below are the gate's scope, in one place. All of broker/, spark_beanstalk/,
# beanstalk_rules/ and pyspark_beanstalk/ are in it; `bash scripts/lint.sh --all` also covers
# the untyped tests, jobs and benchmarks (ruff and mypy report there, for clean-ups).
set -euo pipefail
cd "$(dirname "$0")/.."

# Checked by both ruff and mypy --strict.
CHECKED=(
  beanstalk_rules
  broker
  spark_beanstalk
  pyspark_beanstalk
  jobs/_common.py
  tests/helpers.py
  tests/test_helpers.py
  tests/test_rules.py
)
# Checked by ruff only (untyped test modules).
RUFF_ONLY=(
  tests/conftest.py
  tests/test_broker_cli.py
  tests/test_greenstalk_e2e.py
  tests/test_jobs.py
  tests/test_failover.py
  tests/test_replication.py
  tests/test_replication_unit.py
)
RUFF_PATHS=("${CHECKED[@]}" "${RUFF_ONLY[@]}")
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
