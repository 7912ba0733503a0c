#!/usr/bin/env python3
"""Instructions per recovered job (callgrind), compiled or interpreted: the machine's noise left out.

Writes two binlogs of fresh 100-byte puts (tube "bench", as `bench_binlog.py --only recovery`
fills them), runs `open_binlog` + `recover` over each in a child process under callgrind (the
collector off and the restored jobs frozen, as `broker.server.run_server` does; the child
exits without tearing the jobs down), and divides the difference of the two totals by the
difference of the job counts: start-up and imports cancel out.

    python bench/recovery_instructions.py                 # the build that imports (compiled if built)
    SPARK_BEANSTALK_PURE=1 python bench/recovery_instructions.py
    SPARK_BEANSTALK_PURE=1 python bench/recovery_instructions.py --floor

``--floor`` counts instead the least any interpreted recovery does per job: a head unpack and
a CRC per record, then a field unpack, the body slice, one job object and one heap entry.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import benchlib  # noqa: F401 (puts the repository on sys.path)

from broker import binlog_format as fmt  # noqa: E402


def write_log(directory: str, jobs: int, segment_size: int = 10 << 20) -> None:
    now = time.time_ns()
    idx, jid = 1, 1
    while jid <= jobs:
        seg = bytearray(fmt.encode_header(idx, jid - 1, now))
        while jid <= jobs and len(seg) < segment_size - 300:
            fmt.append_job(seg, jid, 0, 1024, 0, 60 * 10**9, now + jid * 1000, 0, 0, 0, 0, 0, 0, b"bench", b"x" * 100)
            jid += 1
        with open(os.path.join(directory, fmt.segment_name(idx)), "wb") as fh:
            fh.write(seg)
        idx += 1


def child_recover(directory: str) -> None:
    from broker.binlog import open_binlog
    from broker.queue import Queue
    log = open_binlog(directory, fsync_ms=None)
    queue = Queue(time.monotonic_ns, listener=log)
    gc.disable()
    try:
        log.recover(queue)
    finally:
        gc.freeze()
        gc.enable()
    log.close()


def child_floor(directory: str) -> None:
    from broker.jobtable import JobTable
    from broker.model import READY, Tube, new_job
    gc.disable()
    tube = Tube("bench", JobTable())
    head, fields, crc32 = fmt.HEAD.unpack_from, fmt.JOB_FIELDS.unpack_from, fmt.crc32
    frame, fixed = fmt.FRAME_SIZE, fmt.JOB_RECORD_FIXED  # locals: a module attribute is a dict lookup per use
    kept = []
    for name in sorted(n for n in os.listdir(directory) if n.endswith(fmt.SEGMENT_SUFFIX)):
        with open(os.path.join(directory, name), "rb") as fh:
            data = fh.read()
        end, pos = len(data), fmt.HEADER_SIZE
        while pos < end:
            length, crc, _kind, _jid = head(data, pos)
            stop = pos + frame + length
            if crc32(data[pos + frame:stop]) != crc:
                raise SystemExit(f"{name}: bad record at {pos}")
            pos = stop
        pos, jobs, ready = fmt.HEADER_SIZE, [], []
        while pos < end:
            length, job_id, _s, pri, _d, _t, created, _dl, _r, _to, _rl, _b, _k, tube_len = fields(data, pos)
            size = frame + length
            jobs.append(new_job(job_id, tube, pri, 60, data[pos + fixed + tube_len:pos + size], created, READY, 1))
            ready.append((pri << 64) | job_id)
            pos += size
        kept.append((jobs, ready))


def count(directory: str, floor: bool) -> int:
    work = directory + ".work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(directory, work)  # recovery truncates and rewrites: keep the original
    out = directory + ".callgrind"
    try:
        proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                               __file__, "--child-floor" if floor else "--child", work],
                              capture_output=True, text=True, check=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    found = re.search(r"Collected : (\d+)", proc.stderr)
    if found is None:
        raise SystemExit(f"no callgrind total in:\n{proc.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="20000,60000", help="the two log sizes, comma separated")
    p.add_argument("--floor", action="store_true", help="count the least per-job work instead (see above)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-floor", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child or opts.child_floor:
        (child_recover if opts.child else child_floor)(opts.child or opts.child_floor)
        sys.stdout.flush()
        os._exit(0)  # no teardown of the jobs: only the recovery is counted
    if shutil.which("valgrind") is None:
        print("valgrind is needed: apt-get install -y valgrind", file=sys.stderr)
        return 2
    from broker import _build
    small, large = (int(n) for n in opts.jobs.split(","))
    tmp = tempfile.mkdtemp(prefix="recovery-instructions-")
    try:
        totals = []
        for jobs in (small, large):
            directory = os.path.join(tmp, f"log{jobs}")
            os.makedirs(directory)
            write_log(directory, jobs)
            totals.append(count(directory, opts.floor))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    what = "floor (least interpreted work)" if opts.floor else _build.describe()
    print(f"{what}: {(totals[1] - totals[0]) / (large - small):,.0f} instructions per recovered job "
          f"({small:,} jobs: {totals[0]:,}; {large:,} jobs: {totals[1]:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
