#!/usr/bin/env python3
"""Throughput/latency benchmark: our broker vs real beanstalkd 1.12, same run.

Workloads (see bench/loadgen.c): put, cycle (put+reserve+delete), drain (of a
pre-filled tube), each at 1/50/500 connections and pipeline depths 1/64.
For every row and repetition a fresh server process is started; the servers
alternate within a repetition so that background load hits both alike.
Medians over the repetitions are reported.

    python bench/broker_bench.py                 # full run (~15-25 min)
    python bench/broker_bench.py --quick         # 1 rep, 1 s per row (~2-4 min)
    python bench/broker_bench.py --servers beanstalkd --workloads put,cycle --conns 1,50
    python bench/broker_bench.py --pure --workloads put,cycle --conns 50 --depths 1   # both builds of ours
    python bench/broker_bench.py --instructions   # instructions per command under callgrind (load-proof)
    python bench/broker_bench.py --breakdown --quick   # per row: kernel / uvloop / CPython / own code (perf)

Servers per row (bench/servers.py): beanstalkd 1.12, ours, ours-pure (SPARK_BEANSTALK_PURE=1)
and the Python floor (shared/tools/python_floor.py: asyncio + uvloop, no broker logic).
Ratios between them move from machine to machine: the header names the CPU, the Python
build and the load average the table came from.

Prints a markdown table and writes bench/out/broker.json.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SRC = BENCH / "loadgen.c"
BIN = BENCH / "bin" / "loadgen"
OUT = BENCH / "out"

for _path in (str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import servers  # noqa: E402 (found through the sys.path entries above)

SERVER_CPU = 0  # the core the server gets when pinned
CLIENT_CPU = 1  # the core the load generator gets when pinned


# ----------------------------------------------------------------- helpers
def build_loadgen(force: bool = False) -> Path:
    """Compile bench/loadgen.c into bench/bin/loadgen if missing or older than the source."""
    return servers.build_c(SRC, BIN, force)


def raise_nofile(want: int = 65536) -> int:
    """Raise our soft RLIMIT_NOFILE (children inherit it): 500 connections need > 1024 fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def all_cpus() -> set[int]:
    return set(range(os.cpu_count() or 1))


def set_affinity(pid: int, cpus: set[int]) -> None:
    """Pin every thread of pid (threads created later inherit from their creator)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


def git_info() -> dict:
    def run(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""
    return {
        "commit": run("rev-parse", "--short", "HEAD"),
        "broker_dirty": bool(run("status", "--porcelain", "--", "broker")),
        "broker_files": run("ls-files", "--others", "--modified", "--exclude-standard", "--", "broker").split(),
    }


def proc_status(pid: int, key: str) -> int | None:
    """A kB field of /proc/PID/status, in bytes."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start_server(kind: str, ours_args: list[str], log_dir: Path, floor: str | None = None):
    """kind: beanstalkd, ours, ours-pure or floor (see bench/servers.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = servers.server_process(kind, ours_args, stderr_path=str(log_dir / f"{kind}.stderr.log"), floor=floor)
    return proc.start(timeout=30)


def run_loadgen(args: list[str], pin: set[int] | None, timeout: float) -> dict:
    cpus = pin if pin is not None else all_cpus()

    def pre():
        os.sched_setaffinity(0, cpus)

    res = subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=timeout, preexec_fn=pre)
    if not res.stdout.strip():
        raise RuntimeError(f"loadgen failed (rc={res.returncode}): {res.stderr.strip()}")
    data = json.loads(res.stdout.strip().splitlines()[-1])
    data["rc"] = res.returncode
    if res.stderr.strip():
        data["stderr"] = res.stderr.strip()[-500:]
    return data


def one_run(kind: str, workload: str, conns: int, depth: int, pinned: bool, opts) -> dict:
    """Start a fresh server, (pre-fill,) run the workload, stop the server."""
    srv = start_server(kind, opts.ours_args, OUT / "logs", floor=opts.floor)
    try:
        set_affinity(srv.pid, {SERVER_CPU} if pinned else all_cpus())
        client_pin = {CLIENT_CPU} if pinned else None
        base = ["-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-s", str(opts.body)]
        fill = None
        load_before = os.getloadavg()[0]
        if workload == "drain":
            fill = run_loadgen(base + ["-w", "put", "-c", "1", "-d", "64", "-n", str(opts.drain_jobs), "-T", "bench"],
                               client_pin, timeout=opts.drain_timeout)
            data = run_loadgen(base + ["-w", "drain", "-c", str(conns), "-d", str(depth), "-n", str(opts.drain_jobs),
                                       "-T", "bench"], client_pin, timeout=opts.drain_timeout)
        else:
            data = run_loadgen(base + ["-w", workload, "-c", str(conns), "-d", str(depth), "-t", str(opts.seconds),
                                       "-W", str(opts.warmup), "-T", "bench"], client_pin,
                               timeout=opts.seconds + opts.warmup + 120)
        data["server_alive"] = srv.proc.poll() is None
        data["server_vmhwm"] = proc_status(srv.pid, "VmHWM")
        data["loadavg_1m"] = [load_before, os.getloadavg()[0]]
        if fill is not None:
            data["fill"] = {k: fill.get(k) for k in ("seconds", "ops_per_s", "server_cpu_us_per_op", "errors")}
        return data
    finally:
        srv.stop(timeout=10)
        if srv.proc is not None and srv.proc.poll() is None:
            srv.kill()


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# A row whose repetitions of one server lie further apart than this (max/min - 1) was disturbed: on a
# shared VM something outside it can take 20-30% of a repetition, and a ratio read off such a row is the
# disturbance, not the servers. The table names those rows (the last column) instead of hiding them.
UNSTEADY = 0.15


def row_metric(row: dict) -> str:
    """What a row is judged on: jobs a second for drain (a drained job is two commands), else ops a second."""
    return "jobs_per_s" if row["workload"] == "drain" else "ops_per_s"


def spread(runs: list[dict], metric: str = "ops_per_s") -> float | None:
    """How far one server's repetitions of a row lie apart: max/min - 1 of ``metric`` (None: fewer than two)."""
    values = [r[metric] for r in runs if not r.get("failed") and r.get(metric)]
    return max(values) / min(values) - 1 if len(values) > 1 else None


def unsteady(row: dict, limit: float = UNSTEADY) -> dict[str, float]:
    """The servers of ``row`` whose repetitions lie more than ``limit`` apart, with their spread."""
    metric = row_metric(row)
    found = {}
    for kind, runs in row.get("runs", {}).items():
        gap = spread(runs, metric)
        if gap is not None and gap > limit:
            found[kind] = gap
    return found


def summarize(runs: list[dict]) -> dict:
    ok = [r for r in runs if not r.get("failed")]
    if not ok:
        return {"n": 0, "failed": len(runs)}
    return {
        "n": len(ok),
        "failed": len(runs) - len(ok),
        "ops_per_s": med([r["ops_per_s"] for r in ok]),
        "jobs_per_s": med([r["jobs_per_s"] for r in ok]),
        "p50_us": med([r["lat_us"]["p50"] for r in ok]),
        "p99_us": med([r["lat_us"]["p99"] for r in ok]),
        "server_cpu_us_per_op": med([r.get("server_cpu_us_per_op") for r in ok]),
        "server_cpu_pct": med([r.get("server_cpu_pct") for r in ok]),
        "client_cpu_pct": med([r.get("client_cpu_pct") for r in ok]),
        "client_cpu_pct_max": max(r.get("client_cpu_pct", 0) for r in ok),
        "errors": sum(r.get("errors", 0) + r.get("conn_errors", 0) for r in ok),
        "ops_per_s_all": [round(r["ops_per_s"]) for r in ok],
        # how the load generator's reads were cut: replies per recv() (see loadgen.c, "io")
        "replies_per_read": med([r.get("io", {}).get("replies_per_read") for r in ok]),
    }


# ----------------------------------------------------------------- output
def fmt_rate(v):
    if v is None:
        return "-"
    return f"{v / 1000:.1f}k" if v >= 1000 else f"{v:.0f}"


def fmt_lat(us):
    if us is None:
        return "-"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.0f} us"


def fmt_num(v, nd=1):
    return "-" if v is None else f"{v:.{nd}f}"


OURS = ("ours", "ours-pure")
REFERENCES = (("beanstalkd", "bs"), ("floor", "floor"), ("ceiling", "ceiling"), ("wire", "wire"))


def pair_ratios(row: dict, a: str, b: str) -> list[float]:
    """a/b of each repetition in which both ran: the servers of one repetition run back to back, so a
    slow or fast phase of a shared machine touches both sides of a pair, where the medians of a noisy
    row may come from different phases."""
    metric = row_metric(row)
    runs_a, runs_b = row.get("runs", {}).get(a, []), row.get("runs", {}).get(b, [])
    return [x[metric] / y[metric] for x, y in zip(runs_a, runs_b, strict=False)
            if not x.get("failed") and not y.get("failed") and x.get(metric) and y.get(metric)]


def add_ratios(row: dict) -> None:
    """ours/beanstalkd and ours/floor on ops/s (jobs/s for drain), for each build of ours: the ratio of the
    medians, and the median of the repetitions' back-to-back pairs (``pair_ratios``)."""
    metric = row_metric(row)
    ratios = {}
    pairs = {}
    for ours in OURS:
        o = row["servers"].get(ours, {}).get(metric)
        for ref, _ in REFERENCES:
            r = row["servers"].get(ref, {}).get(metric)
            ratios[f"{ours}/{ref}"] = (o / r) if (o is not None and r) else None
            values = pair_ratios(row, ours, ref)
            pairs[f"{ours}/{ref}"] = {"median": med(values), "n": len(values)}
    row["ratios"] = ratios
    row["pair_ratios"] = pairs
    row["ratio"] = ratios.get("ours/beanstalkd")  # the historical column
    oc = row["servers"].get("ours", {}).get("server_cpu_us_per_op")
    bc = row["servers"].get("beanstalkd", {}).get("server_cpu_us_per_op")
    row["cpu_ratio"] = (bc / oc) if (oc and bc) else None  # >= 0.5: ours needs <= 2x CPU per command


def ratio_columns(servers: list[str]) -> list[tuple[str, str]]:
    return [(f"{o}/{ref}", f"{o}/{short}") for o in OURS if o in servers
            for ref, short in REFERENCES if ref in servers]


def markdown(rows: list[dict], servers: list[str]) -> str:
    ratios = ratio_columns(servers)
    hdr = ["workload", "conns", "depth", "pinned"]
    for s in servers:
        hdr += [f"{s} ops/s", f"{s} p50 / p99"]
    hdr += [label for _, label in ratios]
    for s in servers:
        hdr += [f"{s} CPU us/cmd"]
    hdr += [f"repetitions > {UNSTEADY:.0%} apart"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] * 4 + ["---:"] * (len(hdr) - 5) + ["---"]) + "|"]
    for row in rows:
        cells = [row["workload"], str(row["conns"]), str(row["depth"]), "yes" if row["pinned"] else "no"]
        for s in servers:
            m = row["servers"].get(s, {})
            rate = fmt_rate(m.get("ops_per_s"))
            if row["workload"] == "drain" and m.get("jobs_per_s"):
                rate += f" ({fmt_rate(m['jobs_per_s'])} jobs/s)"
            if m.get("failed"):
                rate += f" [{m['failed']} failed]"
            if m.get("errors"):
                rate += f" [{m['errors']} errors]"
            cells += [rate, f"{fmt_lat(m.get('p50_us'))} / {fmt_lat(m.get('p99_us'))}"]
        for key, _ in ratios:
            r = row.get("ratios", {}).get(key)
            pair = row.get("pair_ratios", {}).get(key, {})
            cell = "-" if r is None else f"{r:.2f}"
            if r is not None and pair.get("n", 0) > 1:
                cell += f" ({pair['median']:.2f})"
            cells += [cell]
        for s in servers:
            cells += [fmt_num(row["servers"].get(s, {}).get("server_cpu_us_per_op"))]
        cells += [", ".join(f"{kind} {gap:.0%}" for kind, gap in unsteady(row).items()) or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unsteady_note(rows: list[dict]) -> str:
    """A line under the table: how many rows were disturbed, so their ratios are not read as results."""
    shaky = [f"{row['workload']} {row['conns']}x{row['depth']}" for row in rows if unsteady(row)]
    if not shaky:
        return f"every row steady: each server's repetitions within {UNSTEADY:.0%} of each other"
    return (f"{len(shaky)} row(s) unsteady, a server's repetitions more than {UNSTEADY:.0%} apart (the machine, "
            f"not the servers: rerun them before reading their ratios): {', '.join(shaky)}")


def machine_line(meta: dict) -> str:
    m = meta["machine"]
    builds = "; ".join(f"{k}: {v}" for k, v in meta.get("builds", {}).items())
    return (f"{m['cpu_model']}, {m['nproc']} CPUs, kernel {m['kernel']}; {m['python']}"
            + (f"; {builds}" if builds else ""))


# ----------------------------------------------------------------- profiling
def aggregate_pyspy(raw_path: Path, top: int = 25) -> str:
    """Self and inclusive sample shares per function from py-spy's raw (collapsed) output."""
    self_s: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        self_s[frames[-1]] = self_s.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return "no samples"
    out = [f"{total} samples", "", "self %  function (file)"]
    for f, n in sorted(self_s.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"{100 * n / total:6.1f}  {f}")
    out += ["", "incl %  function (file)"]
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"{100 * n / total:6.1f}  {f}")
    return "\n".join(out)


def profile_ours(spec: str, opts) -> int:
    """--profile WORKLOAD:CONNS:DEPTH: run one workload against our broker under py-spy."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        print("py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    workload, conns, depth = spec.split(":")
    conns, depth = int(conns), int(depth)
    OUT.mkdir(parents=True, exist_ok=True)
    tag = f"{workload}_c{conns}_d{depth}{'_native' if opts.native else ''}"
    raw = OUT / f"profile_{tag}.raw.txt"
    srv = start_server(opts.profile_server, opts.ours_args, OUT / "logs", floor=opts.floor)
    spy = None
    try:
        pinned = conns == 1 or opts.pin == "all"
        set_affinity(srv.pid, {SERVER_CPU} if pinned else all_cpus())
        base = ["-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-s", str(opts.body), "-T", "bench"]
        if workload == "drain":
            fill = ["-w", "put", "-c", "1", "-d", "64", "-n", str(opts.drain_jobs)]
            run_loadgen(base + fill, None, opts.drain_timeout)
        cmd = [pyspy, "record", "--pid", str(srv.pid), "--format", "raw", "--output", str(raw), "--nolineno",
               "--rate", "250", "--nonblocking", "--duration", str(int(opts.seconds + 1))]
        if opts.native:  # native unwinding has to pause the process: slower, but shows C frames
            cmd = [c for c in cmd if c != "--nonblocking"] + ["--native"]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
        if workload == "drain":
            data = run_loadgen(base + ["-w", "drain", "-c", str(conns), "-d", str(depth), "-n", str(opts.drain_jobs)],
                               {CLIENT_CPU} if pinned else None, opts.drain_timeout)
        else:
            data = run_loadgen(base + ["-w", workload, "-c", str(conns), "-d", str(depth), "-t", str(opts.seconds),
                                       "-W", "0"], {CLIENT_CPU} if pinned else None, opts.seconds + 120)
        _, err = spy.communicate(timeout=opts.seconds + 60)
        spy = None
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
            spy.wait()
        srv.stop(timeout=10)
    print(f"{workload} c={conns} d={depth}: {data['ops_per_s']:.0f} ops/s under py-spy, "
          f"server {data.get('server_cpu_us_per_op', 0):.1f} us CPU/op", file=sys.stderr)
    report = aggregate_pyspy(raw) if raw.exists() else f"py-spy wrote nothing: {err}"
    (OUT / f"profile_{tag}.txt").write_text(report + "\n")
    print(report)
    print(f"raw stacks: {raw}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repetition, 1 s rows, 20k-job drains")
    p.add_argument("--servers", default=None,
                   help="comma list of: beanstalkd, ours, ours-pure, floor, ceiling, wire (see bench/servers.py); "
                        "default beanstalkd,ours,floor (--breakdown: all four)")
    p.add_argument("--pure", action="store_true",
                   help="also run ours-pure (SPARK_BEANSTALK_PURE=1): both builds of ours side by side")
    p.add_argument("--floor", default=None, help="path of python_floor.py (default: shared/tools/ beside the repo)")
    p.add_argument("--instructions", action="store_true",
                   help="instead of the table: instructions per command under callgrind (see bench/instructions.py)")
    p.add_argument("--instr-ops", type=int, default=20000, help="with --instructions: commands measured per row")
    p.add_argument("--cache-sim", action="store_true",
                   help="with --instructions: also simulate the caches (callgrind --cache-sim) and print data-cache "
                        "misses per command; the last level simulated is this machine's per-core L2")
    p.add_argument("--cache-model", default=None, metavar="D1,WAYS:L2,WAYS",
                   help="with --cache-sim: simulate these caches instead of this machine's, e.g. 32K,8:512K,8 (the "
                        "AMD EPYC VM's), so that counts from two machines can be set side by side")
    p.add_argument("--annotate", type=int, default=0, metavar="N",
                   help="with --instructions: also print the N most expensive C functions (callgrind_annotate)")
    p.add_argument("--breakdown", action="store_true",
                   help="instead of the table: per row, where each server's CPU goes (kernel / uvloop / CPython / "
                        "own code / other; see bench/breakdown.py); --quick: 50 connections only")
    p.add_argument("--tool", choices=("perf", "callgrind"), default="perf",
                   help="with --breakdown: perf record (CPU time) or callgrind (user-space instructions)")
    p.add_argument("--workloads", default="put,cycle,drain", help="comma list of: put, cycle, drain")
    p.add_argument("--conns", default="1,50,500")
    p.add_argument("--depths", default="1,64")
    p.add_argument("--reps", type=int, default=None, help="repetitions per row (default 3, quick 1)")
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per run (default 3, quick 1)")
    p.add_argument("--warmup", type=float, default=None, help="unmeasured warm-up seconds (default 0.5, quick 0.2)")
    p.add_argument("--drain-jobs", type=int, default=None,
                   help="jobs pre-filled for drain (default 100000, quick 20000)")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="give up on one fill/drain after this many s")
    p.add_argument("--body", type=int, default=100, help="job body bytes")
    p.add_argument("--pin", choices=("one", "all", "none"), default="one",
                   help="pin server/loadgen to different cores for: 1-connection rows (default), all rows, none")
    p.add_argument("--ours-args", default="", help="extra arguments for `python -m broker` (space separated)")
    p.add_argument("--out", default=str(OUT / "broker.json"))
    p.add_argument("--rebuild", action="store_true", help="recompile the load generator")
    p.add_argument("--profile", metavar="WORKLOAD:CONNS:DEPTH",
                   help="instead of the table: run that one row against our broker under py-spy, print hot spots")
    p.add_argument("--native", action="store_true", help="with --profile: include native (C) frames")
    p.add_argument("--profile-server", default="ours", choices=("ours", "ours-pure", "floor"),
                   help="with --profile: which server to profile")
    p.add_argument("--table-from", metavar="JSON[,JSON...]",
                   help="only re-print the markdown table of an earlier run's JSON; several (comma-separated): "
                        "their repetitions pooled, row by row")
    o = p.parse_args(argv)
    if o.breakdown:
        o.reps = o.reps or 1
        o.servers = o.servers or ",".join(servers.KINDS)
        if o.quick and o.conns == "1,50,500":
            o.conns = "50"
    o.servers = o.servers or "beanstalkd,ours,floor"
    o.reps = o.reps or (1 if o.quick else 3)
    o.seconds = o.seconds or (1.0 if o.quick else 3.0)
    o.warmup = o.warmup if o.warmup is not None else (0.2 if o.quick else 0.5)
    o.drain_jobs = o.drain_jobs or (20000 if o.quick else 100000)
    o.servers = [s for s in o.servers.split(",") if s]
    o.workloads = [w for w in o.workloads.split(",") if w]
    o.conns = [int(c) for c in o.conns.split(",") if c]
    o.depths = [int(d) for d in o.depths.split(",") if d]
    o.ours_args = o.ours_args.split()
    if o.pure and "ours-pure" not in o.servers:
        o.servers.insert(o.servers.index("ours") + 1 if "ours" in o.servers else len(o.servers), "ours-pure")
    for s in o.servers:
        if s not in servers.KINDS:
            p.error(f"unknown server {s} (one of {', '.join(servers.KINDS)})")
    if "floor" in o.servers or o.profile_server == "floor":
        try:
            o.floor = str(servers.floor_script(o.floor))
        except servers.FloorMissing as exc:
            p.error(str(exc))
    for w in o.workloads:
        if w not in ("put", "cycle", "drain"):
            p.error(f"unknown workload {w}")
    return o


PAIRS_NOTE = ("each ratio: of the medians, then (in brackets) the median of the repetitions' ratios, a pair of "
              "servers running back to back")


NOT_RUN = {"failed": True, "error": "not run"}  # a server one pooled run left out of a row


def pool_rows(runs_of: list[dict]) -> tuple[list[dict], list[str]]:
    """The rows of several runs' JSON (or one's) as one table: each row's repetitions of every run, in order. A
    server a run left out of a row counts as failed there, so that repetition i of one server still pairs with
    repetition i of another (a row's runs are lists indexed by repetition)."""
    servers: list[str] = []
    pooled: dict[tuple, dict] = {}
    reps_so_far: dict[tuple, int] = {}
    for data in runs_of:
        servers += [s for s in data["meta"]["args"]["servers"] if s not in servers]
        for row in data["rows"]:
            key = (row["workload"], row["conns"], row["depth"])
            into = pooled.setdefault(key, {"workload": key[0], "conns": key[1], "depth": key[2],
                                           "pinned": row["pinned"], "runs": {}})
            into["pinned"] = into["pinned"] and row["pinned"]
            before = reps_so_far.get(key, 0)
            reps = max((len(runs) for runs in row["runs"].values()), default=0)
            for kind in [*into["runs"], *(k for k in row["runs"] if k not in into["runs"])]:  # first seen, first
                into["runs"].setdefault(kind, [NOT_RUN] * before).extend(row["runs"].get(kind) or [NOT_RUN] * reps)
            reps_so_far[key] = before + reps
    rows = list(pooled.values())
    for row in rows:
        row["servers"] = {kind: summarize(runs) for kind, runs in row["runs"].items()}
    return rows, servers


def table_from(paths: str) -> int:
    """Re-print the table of one run's JSON, or (comma-separated paths) of several runs pooled."""
    runs_of = []
    for path in paths.split(","):
        try:
            data = json.loads(Path(path).read_text())
            args = data.get("meta", {}).get("args", {}) if isinstance(data, dict) else {}
            if "rows" not in data or "servers" not in args:
                raise ValueError("no rows or meta.args.servers")
        except (OSError, ValueError, TypeError) as exc:
            print(f"--table-from: {path} is not a broker_bench.py result ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            return 2
        runs_of.append(data)
    rows, servers = pool_rows(runs_of)
    for row in rows:
        add_ratios(row)
    print(markdown(rows, servers))
    print(unsteady_note(rows))
    if any(pair["n"] > 1 for row in rows for pair in row["pair_ratios"].values()):
        print(PAIRS_NOTE)
    for data in runs_of:
        meta = data["meta"]
        if "machine" in meta:
            print(f"\n{machine_line(meta)}")
        print(f"\nstarted {meta['started_utc']}, finished {meta.get('finished_utc')}, commit {meta['git']['commit']}"
              f"{' + uncommitted broker/' if meta['git']['broker_dirty'] else ''}; load average at start "
              f"{meta['loadavg_start'][0]:.2f}, at end {meta.get('loadavg_end', [0])[0]:.2f}; "
              f"{meta['args'].get('reps')} rep(s)")
    return 0



def row_grid(opts):
    """The table's rows in order, (workload, conns, depth, pinned): the one home of the pinning rule
    (--pin one pins the 1-connection rows only), shared with --breakdown."""
    for workload in opts.workloads:
        for conns in opts.conns:
            for depth in opts.depths:
                yield workload, conns, depth, opts.pin == "all" or (opts.pin == "one" and conns == 1)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.table_from and opts.breakdown:
        import breakdown

        return breakdown.table_from(opts.table_from)
    if opts.table_from:
        return table_from(opts.table_from)
    os.chdir(ROOT)  # `python -m broker` must find the package
    build_loadgen(force=opts.rebuild)
    nofile = raise_nofile()
    if opts.profile:
        return profile_ours(opts.profile, opts)
    if opts.breakdown:
        import breakdown

        return breakdown.main(opts)
    if opts.instructions:
        import instructions

        return instructions.main(opts)
    if max(opts.conns) + 64 > nofile:
        print(f"warning: RLIMIT_NOFILE is {nofile}; {max(opts.conns)} connections may fail", file=sys.stderr)
    started = _dt.datetime.now(_dt.UTC)
    meta = {
        "started_utc": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git": git_info(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "args": {k: v for k, v in vars(opts).items()},
        "machine": servers.machine(),
        "builds": {kind: servers.build_of_ours(kind == "ours-pure") for kind in opts.servers if kind in OURS},
    }
    try:
        meta["beanstalkd_version"] = subprocess.run(["beanstalkd", "-v"], capture_output=True, text=True).stdout.strip()
    except OSError:
        meta["beanstalkd_version"] = None
    print(f"# broker bench {meta['started_utc']} commit {meta['git']['commit']}"
          f"{' (broker/ has uncommitted changes)' if meta['git']['broker_dirty'] else ''}"
          f", load {meta['loadavg_start'][0]:.2f}",
          file=sys.stderr)
    print(f"# {machine_line(meta)}", file=sys.stderr)

    rows = []
    for workload, conns, depth, pinned in row_grid(opts):
        row = {"workload": workload, "conns": conns, "depth": depth, "pinned": pinned, "runs": {}, "servers": {}}
        for rep in range(opts.reps):
            order = opts.servers if rep % 2 == 0 else list(reversed(opts.servers))
            for kind in order:
                if kind == "ceiling" and depth > 1:
                    continue  # it answers one command per packet (see bench/ceiling_server.py)
                try:
                    data = one_run(kind, workload, conns, depth, pinned, opts)
                except Exception as exc:  # a crashed/hung server is a result, not a bench failure
                    data = {"failed": True, "error": f"{type(exc).__name__}: {exc}"[:500]}
                row["runs"].setdefault(kind, []).append(data)
                if data.get("failed"):
                    msg = data["error"]
                else:
                    msg = (f"{data['ops_per_s']:>9.0f} ops/s p50 {data['lat_us']['p50']:>8.0f}us "
                           f"p99 {data['lat_us']['p99']:>8.0f}us srv {data.get('server_cpu_us_per_op', 0):5.1f}us/op "
                           f"{data.get('server_cpu_pct', 0):3.0f}% "
                           f"gen {data['client_cpu_pct']:4.0f}% load {data['loadavg_1m'][1]:.2f}"
                           + (f" replies/read {data['io']['replies_per_read']:.1f}" if "io" in data else "")
                           + (f" ERR {data['errors']}+{data['conn_errors']} {data['first_error']}"
                              if data['errors'] or data['conn_errors'] else ""))
                print(f"  {workload:5} c={conns:<3} d={depth:<2} rep {rep + 1} {kind:10} {msg}", file=sys.stderr)
        for kind in opts.servers:
            row["servers"][kind] = summarize(row["runs"].get(kind, []))
        add_ratios(row)
        rows.append(row)

    meta["finished_utc"] = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta["loadavg_end"] = os.getloadavg()
    table = markdown(rows, opts.servers)
    gen_max = max((m.get("client_cpu_pct_max") or 0) for r in rows for m in r["servers"].values())
    print(table)
    print(unsteady_note(rows))
    if opts.reps > 1:
        print(PAIRS_NOTE)
    print(f"\nstarted {meta['started_utc']}, finished {meta['finished_utc']}, commit {meta['git']['commit']}"
          f"{' + uncommitted broker/' if meta['git']['broker_dirty'] else ''}; "
          f"load average at start {meta['loadavg_start'][0]:.2f}, at end {meta['loadavg_end'][0]:.2f}; "
          f"{opts.reps} rep(s), medians; load generator peak CPU {gen_max:.0f}% of one core")
    print(machine_line(meta))
    print("Ratios move between machines (CPU, kernel, Python build): compare servers of one run only.")
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "table_md": table}, indent=1, default=str))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
