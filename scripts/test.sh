#!/usr/bin/env bash
# Install everything the test suite needs, run the lint gate (scripts/lint.sh: ruff, mypy --strict),
# then the suite. README's second command; .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/need.sh
need beanstalkd beanstalkd  # the differential suite and the client suites run against beanstalkd 1.12 too
need chromium chromium  # the dashboard's browser tests (Playwright drives it)
need etcd etcd-server  # replication failover tests (leadership held in etcd)
need fusermount3 fuse3  # tests/faultfs.py: I/O errors under the binlog
need java openjdk-17-jre-headless  # Spark
need cc gcc libc6-dev  # bench/loadgen.c (the benchmark smoke tests) and the compiled broker core
python3 -m pip install -q --disable-pip-version-check -e '.[test]' --config-settings editable_mode=compat
# A machine with a working C compiler must get the compiled core: a hot module mypyc cannot compile
# would otherwise fall back to interpreted code without a word, and CI would test only that.
if cc --version >/dev/null 2>&1 && [ -z "${SPARK_BEANSTALK_NO_COMPILE:-}" ]; then
  python3 -c 'import sys; from broker import _build, netio; b = _build.inspect_build(); t = netio.status()[1]; print("broker core:", b.reason, "/ client sockets:", t); sys.exit(0 if b.compiled and netio.available() else 1)' \
    || { echo "the broker core did not compile (see the pip output above); SPARK_BEANSTALK_NO_COMPILE=1 skips the compile on purpose" >&2; exit 1; }
fi
bash scripts/lint.sh  # ruff + mypy --strict over the gated paths; an error stops the run here
# Two workers (pytest-xdist): the suite mostly waits (servers, timers, Spark), so a second worker
# halves the wall clock. --dist loadgroup + tests/conftest.py keep every test of the `spark` fixture
# on one worker (one SparkSession, one JVM) and each other module whole. TEST_WORKERS=0: serial.
XDIST=(-n "${TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder)  # the spark group first (tests/conftest.py)
python3 -m pytest "${XDIST[@]}" -m "not slow" -p no:cacheprovider "$@"
# The install compiled the broker core (mypyc) if it could: then the protocol suites run a second
# time on the interpreted core, which is what machines without a C compiler get: the differential,
# greenstalk, fuzz and crash suites whole, the queue's, binlog's and replication's in-process suites,
# the lane's (interpreted only) with the heap check of a broker without a binlog (the lane's case),
# and the failover snapshot test, whose loop turns an interpreted leader missed once. The binlog's
# fault and process suites, the busy poll's and the replication process tests run on the compiled
# core only (pass 1): 80 s of work the interpreted pass added to a CI run of 903 s.
if [ $# -eq 0 ] && python3 -c 'import sys; from broker import _build; sys.exit(0 if _build.inspect_build().compiled else 1)'; then
  echo "== again with SPARK_BEANSTALK_PURE=1 (interpreted broker core)"
  SPARK_BEANSTALK_PURE=1 exec python3 -m pytest "${XDIST[@]}" -m "not slow" -p no:cacheprovider -k "not beanstalkd" \
    tests/differential tests/test_greenstalk_e2e.py tests/test_fuzz.py tests/test_binlog_crash.py tests/test_queue.py \
    tests/test_jobtable.py tests/test_binlog_recovery.py tests/test_binlog_differential.py tests/test_server_inprocess.py \
    tests/test_binlog_batch.py tests/test_binlog_format.py tests/test_replication_unit.py \
    tests/test_failover.py::test_a_new_member_joining_by_snapshot_neither_stalls_nor_fences_the_leader tests/test_build_select.py \
    tests/test_lane.py 'tests/test_steady_heap.py::test_rounds_of_the_same_work_leave_the_heap_as_it_was[memory]' \
    tests/test_netio.py::test_a_client_flooding_commands_does_not_hold_the_loop \
    'tests/test_netio.py::test_a_closed_connection_leaves_no_reference_cycle[uvloop]'
fi
