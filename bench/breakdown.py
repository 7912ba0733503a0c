"""Where a server's CPU goes per command: kernel / uvloop / CPython / its own code / other.

Issue 16 asks, per row of the broker benchmark, how much of the remaining time is ours
and how much is the kernel and uvloop that every Python server pays. For each row and
each server (beanstalkd, ours, ours-pure, the Python floor) a fresh server runs under the
load generator exactly as in the throughput table, while ``perf record -e cpu-clock``
samples it (every thread, user and kernel, a fixed period of on-CPU time, so idle time
is not sampled). Each sample is classified by the object its instruction pointer is in:

* ``kernel``  - ``[kernel.kallsyms]``: system calls, TCP/IP over loopback, epoll,
  scheduling (``net`` is the part whose symbol belongs to the network stack);
* ``uvloop``  - uvloop's extension module (libuv is linked into it);
* ``cpython`` - libpython / the python binary and the stdlib's C modules: the eval loop,
  allocation, GC, dicts... For ``ours-pure`` and ``floor`` this includes their Python
  logic, which runs inside the eval loop;
* ``own``     - the server's own machine code: ``broker/*.so`` + ``broker__mypyc*.so``
  (the mypyc-compiled core) for ours, the ``beanstalkd`` binary for beanstalkd, ``wire_server`` for
  the wire server (bench/wire_server.c);
* ``other``   - libc, the dynamic loader, the vDSO, everything else.

The shares are multiplied by the server's CPU per command from ``/proc/PID/stat`` over
the load generator's measured window (the same figure as the table's "CPU us/cmd"), so
every category is also given in microseconds per command.

Shares of CPU time move less with the machine's load than ops/s, but they are not
load-proof (a server that gets less CPU finds more commands per wake-up and spends fewer
system calls per command). ``--tool callgrind`` gives the user-space split in
instructions per command instead (load-proof: bench/instructions.py counts only the
measured commands), and takes the kernel's share from ``/proc/PID/stat`` stime per
command in a normal (not valgrind) run of the same row.

    python bench/broker_bench.py --breakdown --quick                 # 50 conns, depths 1 and 64 (~1-2 min)
    python bench/broker_bench.py --breakdown                         # every row, 4 servers (~10 min)
    python bench/broker_bench.py --breakdown --workloads put --conns 50 --depths 1 --tool callgrind

Writes bench/out/breakdown.json.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import broker_bench as bb
import servers

CATEGORIES = ("kernel", "uvloop", "cpython", "own", "other")
PERIOD_NS = 250_000  # one sample per 250 us of on-CPU time (4 kHz while running)
NET = re.compile(r"tcp|^__?ip|^ip|inet|skb|sock|^sk_|^__sk|netif|napi|^net|_net_|loopback|dev_queue|"
                 r"dev_hard|nf_|_copy_to_iter|_copy_from_iter|copy_user|csum|neigh|dst_|fib_|raw_")
SAMPLE = re.compile(r"^\s*(\S+)\s+(.*?)\s+\((.*)\)\s*$")


@dataclass
class Split:
    """Sample counts per category (and the net-stack part of the kernel's)."""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    net: int = 0
    total: int = 0
    top: dict[str, int] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        return {c: (100.0 * n / self.total if self.total else 0.0) for c, n in self.counts.items()}


def classify(dso: str, kind: str) -> str:
    """The category of one sample, from the object it hit."""
    if dso.startswith("[kernel") or dso.startswith("[guest.kernel"):
        return "kernel"
    name = os.path.basename(dso)
    if "uvloop" in dso:
        return "uvloop"
    if (kind, name) in (("beanstalkd", "beanstalkd"), ("wire", "wire_server")):
        return "own"
    if name.startswith("broker__mypyc") or ("/broker/" in dso and name.endswith(".so")):
        return "own"
    if name.startswith("libpython") or re.match(r"python3(\.\d+)?$", name) or "/lib-dynload/" in dso:
        return "cpython"
    return "other"


def parse_script(text: str, kind: str, top_n: int = 12) -> Split:
    """Aggregate `perf script -F ip,sym,dso` lines (fixed sampling period: one line = one unit)."""
    split = Split()
    top: dict[str, int] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        _, sym, dso = m.groups()
        cat = classify(dso, kind)
        split.counts[cat] += 1
        split.total += 1
        if cat == "kernel" and NET.search(sym):
            split.net += 1
        key = f"{cat}: {sym or '?'} ({os.path.basename(dso)})"
        top[key] = top.get(key, 0) + 1
    split.top = dict(sorted(top.items(), key=lambda kv: -kv[1])[:top_n])
    return split


def perf_usable() -> str | None:
    """None when `perf record` can sample a process here, else why not."""
    perf = shutil.which("perf")
    if perf is None:
        return "perf not found (apt-get install -y linux-perf)"
    res = subprocess.run([perf, "record", "-q", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"],
                         capture_output=True, text=True, timeout=30, check=False)
    if res.returncode != 0:
        paranoid = Path("/proc/sys/kernel/perf_event_paranoid")
        level = paranoid.read_text().strip() if paranoid.exists() else "?"
        return f"perf record failed (perf_event_paranoid={level}): {res.stderr.strip()[-300:]}"
    return None


class PerfRecorder:
    """`perf record` attached to one pid, from start() until stop()."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out, self.proc = pid, out, None

    def start(self) -> PerfRecorder:
        self.proc = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-c", str(PERIOD_NS), "-p",
                                      str(self.pid), "-o", str(self.out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def stop(self) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.proc = None
        return err or ""

    def script(self) -> str:
        res = subprocess.run(["perf", "script", "-i", str(self.out), "-F", "ip,sym,dso"], capture_output=True,
                             text=True, timeout=300, check=False)
        return res.stdout


def _attached(pid: int) -> bool:
    """True once perf (pid) holds its perf_event file descriptors: sampling has begun."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]" for fd in fds)
    except OSError:
        return False


def _wait_attached(rec: PerfRecorder, timeout: float = 30.0) -> None:
    """Sample from the start of the measured window, not late: wait until perf has attached."""
    deadline = time.monotonic() + timeout
    while rec.proc is not None and not _attached(rec.proc.pid):
        if rec.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"perf record did not attach: {rec.stop().strip()[-300:]}")
        time.sleep(0.01)


def sample_row(kind: str, workload: str, conns: int, depth: int, pinned: bool, opts) -> dict:
    """One fresh server under the load generator and perf: CPU per command and its split."""
    work = bb.OUT / "perf"
    work.mkdir(parents=True, exist_ok=True)
    srv = bb.start_server(kind, opts.ours_args, bb.OUT / "logs", floor=opts.floor)
    rec = PerfRecorder(srv.pid, work / f"{kind}_{workload}_c{conns}_d{depth}.data")
    try:
        bb.set_affinity(srv.pid, {bb.SERVER_CPU} if pinned else bb.all_cpus())
        pin = {bb.CLIENT_CPU} if pinned else None
        base = ["-h", srv.host, "-p", str(srv.port), "-P", str(srv.pid), "-s", str(opts.body), "-T", "bench"]
        if workload == "drain":
            bb.run_loadgen(base + ["-w", "put", "-c", "1", "-d", "64", "-n", str(opts.drain_jobs)], pin,
                           timeout=opts.drain_timeout)
            rec.start()
            _wait_attached(rec)
            data = bb.run_loadgen(base + ["-w", "drain", "-c", str(conns), "-d", str(depth), "-n",
                                          str(opts.drain_jobs)], pin, timeout=opts.drain_timeout)
        else:
            rec.start()
            _wait_attached(rec)
            data = bb.run_loadgen(base + ["-w", workload, "-c", str(conns), "-d", str(depth), "-t",
                                          str(opts.seconds), "-W", str(opts.warmup)], pin,
                                  timeout=opts.seconds + opts.warmup + 120)
        err = rec.stop()
    finally:
        rec.stop()
        srv.stop(timeout=10)
    split = parse_script(rec.script(), kind)
    rec.out.unlink(missing_ok=True)
    if not split.total:
        raise RuntimeError(f"perf recorded no samples of {kind}: {err.strip()[-300:]}")
    return result_of(data, split)


def result_of(data: dict, split: Split) -> dict:
    cpu = data.get("server_cpu_us_per_op") or 0.0
    shares = split.shares()
    return {
        "ops_per_s": data["ops_per_s"], "jobs_per_s": data["jobs_per_s"], "errors": data.get("errors", 0),
        "cpu_us_per_cmd": cpu, "user_us_per_cmd": data.get("server_user_us_per_op"),
        "sys_us_per_cmd": data.get("server_sys_us_per_op"), "server_cpu_pct": data.get("server_cpu_pct"),
        "samples": split.total, "shares_pct": shares,
        "us_per_cmd": {c: cpu * s / 100.0 for c, s in shares.items()},
        "kernel_net_pct": 100.0 * split.net / split.total if split.total else 0.0,
        "top": split.top,
    }


# ----------------------------------------------------------------- callgrind variant
NAMED = re.compile(r"^(c?ob)=\((\d+)\)(?: (.*))?$")


def callgrind_split(out_file: Path, kind: str) -> Split:
    """Self instructions per category, read straight from a callgrind file (user space: no kernel).

    The file names objects once (``ob=(3) /path``, or first in a ``cob=`` line) and then by
    number; a cost line's cost is its last number, except the line right after ``calls=``
    (the callee's inclusive cost, already counted in the callee).
    """
    names: dict[str, str] = {}
    split = Split()
    by_obj: dict[str, int] = {}
    obj, skip_next = "?", False
    with out_file.open(errors="replace") as f:
        for line in f:
            if not line or line[0] in "0123456789+-*":
                if skip_next:
                    skip_next = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    by_obj[obj] = by_obj.get(obj, 0) + int(parts[-1])
                continue
            if line.startswith("calls="):
                skip_next = True
                continue
            m = NAMED.match(line.rstrip("\n"))
            if m:
                tag, num, name = m.groups()
                if name:
                    names[num] = name
                if tag == "ob":
                    obj = names.get(num, "?")
    for name, n in by_obj.items():
        cat = classify(name, kind)
        split.counts[cat] += n
        split.total += n
    split.top = {os.path.basename(k): v for k, v in sorted(by_obj.items(), key=lambda kv: -kv[1])[:12]}
    return split


def callgrind_row(kind: str, workload: str, conns: int, depth: int, pinned: bool, opts) -> dict:
    """User-space instructions per command by category (callgrind) + kernel us/cmd from a normal run."""
    import instructions

    counted = instructions.count(kind, workload, conns, depth, opts.instr_ops, opts)
    split = callgrind_split(Path(counted["callgrind_file"]), kind)
    normal = bb.one_run(kind, workload, conns, depth, pinned, opts)
    cmds = counted["commands"] or 1
    return {
        "ops_per_s": normal["ops_per_s"], "jobs_per_s": normal["jobs_per_s"], "errors": normal.get("errors", 0),
        "cpu_us_per_cmd": normal.get("server_cpu_us_per_op"), "user_us_per_cmd": normal.get("server_user_us_per_op"),
        "sys_us_per_cmd": normal.get("server_sys_us_per_op"), "instr_per_cmd": split.total / cmds,
        "instr_by_category": {c: n / cmds for c, n in split.counts.items()},
        "shares_pct": split.shares(), "top": split.top,
    }


# ----------------------------------------------------------------- output
def row_table(row: dict) -> str:
    if any("instr_by_category" in r for r in row["servers"].values()):
        return _instr_table(row)
    hdr = ["server", "ops/s", "CPU us/cmd", *(f"{c} %" for c in CATEGORIES), "(net %)",
           *(f"{c} us" for c in CATEGORIES)]
    lines = [_title(row), "", "| " + " | ".join(hdr) + " |", "|---|" + "---:|" * (len(hdr) - 1)]
    for kind, r in row["servers"].items():
        if "failed" in r:
            lines.append(f"| {kind} | failed: {r['failed']} |")
            continue
        rate = r["jobs_per_s"] if row["workload"] == "drain" else r["ops_per_s"]
        cells = [kind, bb.fmt_rate(rate) + (" jobs/s" if row["workload"] == "drain" else ""),
                 f"{r['cpu_us_per_cmd']:.1f}", *(f"{r['shares_pct'][c]:.0f}" for c in CATEGORIES),
                 f"{r['kernel_net_pct']:.0f}", *(f"{r['us_per_cmd'][c]:.2f}" for c in CATEGORIES)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _instr_table(row: dict) -> str:
    hdr = ["server", "CPU us/cmd (user / sys)", "user instr/cmd", *(f"{c} instr" for c in CATEGORIES if c != "kernel")]
    lines = [_title(row), "", "| " + " | ".join(hdr) + " |", "|---|" + "---:|" * (len(hdr) - 1)]
    for kind, r in row["servers"].items():
        if "failed" in r:
            lines.append(f"| {kind} | failed: {r['failed']} |")
            continue
        cpu = f"{r['cpu_us_per_cmd'] or 0:.1f} ({r['user_us_per_cmd'] or 0:.1f} / {r['sys_us_per_cmd'] or 0:.1f})"
        cells = [kind, cpu, f"{r['instr_per_cmd']:,.0f}",
                 *(f"{r['instr_by_category'][c]:,.0f}" for c in CATEGORIES if c != "kernel")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _title(row: dict) -> str:
    return f"**{row['workload']} {row['conns']}x{row['depth']}**{' (pinned)' if row['pinned'] else ''}"


def summary_table(rows: list[dict]) -> str:
    """Every row on one line: per server, CPU us/cmd = kernel + uvloop + CPython + own + other."""
    kinds = list(dict.fromkeys(k for r in rows for k in r["servers"]))
    hdr = ["row", *(f"{k} us/cmd = kernel + uvloop + CPython + own + other" for k in kinds)]
    lines = ["| " + " | ".join(hdr) + " |", "|---|" + "---:|" * len(kinds)]
    for row in rows:
        cells = [f"{row['workload']} {row['conns']}x{row['depth']}"]
        for k in kinds:
            r = row["servers"].get(k, {})
            us = r.get("us_per_cmd")
            cells.append(f"**{r['cpu_us_per_cmd']:.1f}** = " + " + ".join(f"{us[c]:.1f}" for c in CATEGORIES)
                         if us else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_from(path: str) -> int:
    """Re-print the summary of an earlier --breakdown run's JSON."""
    data = json.loads(Path(path).read_text())
    print(summary_table(data["rows"]))
    meta = data["meta"]
    print(f"\n{bb.machine_line(meta)}; git {meta['git']['commit']}; load average at end {meta['loadavg_end'][0]:.2f}")
    return 0


def main(opts) -> int:
    if opts.tool == "perf":
        why = perf_usable()
        if why:
            print(f"--breakdown: {why}; try --tool callgrind", file=sys.stderr)
            return 2
    elif shutil.which("callgrind_annotate") is None:
        print("--tool callgrind needs valgrind (apt-get install -y valgrind)", file=sys.stderr)
        return 2
    measure = sample_row if opts.tool == "perf" else callgrind_row
    meta = {"machine": servers.machine(), "git": bb.git_info(), "tool": opts.tool, "seconds": opts.seconds,
            "builds": {k: servers.build_of_ours(k == "ours-pure") for k in opts.servers if k.startswith("ours")}}
    print(f"# breakdown ({opts.tool}); {bb.machine_line(meta)}; load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    rows = []
    for workload, conns, depth, pinned in bb.row_grid(opts):
        row = {"workload": workload, "conns": conns, "depth": depth, "pinned": pinned, "servers": {}}
        for kind in opts.servers:
            if kind == "ceiling" and depth > 1:
                continue  # it answers one command per packet (see bench/ceiling_server.py), as in the table
            try:
                row["servers"][kind] = measure(kind, workload, conns, depth, pinned, opts)
            except Exception as exc:  # noqa: BLE001 - a server that fails is a result
                row["servers"][kind] = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"  {workload:5} {conns}x{depth} {kind:10} {_brief(row['servers'][kind])}", file=sys.stderr)
        rows.append(row)
        print(row_table(row) + "\n")
    meta["loadavg_end"] = os.getloadavg()
    if opts.tool == "perf":
        print("Server CPU per command, split (us)\n")
        print(summary_table(rows))
    print(f"\n{bb.machine_line(meta)}; git {meta['git']['commit']}; load average at end {meta['loadavg_end'][0]:.2f}")
    out = Path(opts.out) if opts.out != str(bb.OUT / "broker.json") else bb.OUT / "breakdown.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all("failed" not in r for row in rows for r in row["servers"].values()) else 1


def _brief(r: dict) -> str:
    if "failed" in r:
        return r["failed"]
    parts = " ".join(f"{c} {r['shares_pct'][c]:.0f}%" for c in CATEGORIES)
    return f"{r['cpu_us_per_cmd'] or 0:5.1f} us/cmd  {parts}"

