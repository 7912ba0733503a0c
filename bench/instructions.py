"""Instructions per command under callgrind: a measure that ignores the machine's load.

Wall-clock ratios on a shared machine move by 10-20% between runs; the number of
instructions a server executes per command does not. Each server runs under
``valgrind --tool=callgrind --instr-atstart=no``; after a warm-up (imports, caches, the
first allocations), counting is switched on with ``callgrind_control -i on``, the load
generator sends exactly ``--instr-ops`` commands, counting is switched off, and the
server's total is divided by the commands. The load generator runs stepped (``loadgen -S``):
counting starts once its connections are set up and stops before it closes them, so a row
counts commands, not the accepts and teardowns of its connections (at 500 connections
these added ~1,250 instructions a command to ours, ~420 to the floor, before the steps).
Only user-space instructions are counted
(callgrind does not see the kernel), so this is the server's own cost per command:
interpreter, uvloop, libc, our code. ``perf stat -e instructions`` would add the kernel,
but most VMs do not expose the counter (``perf stat`` says ``<not supported>``).

    python bench/broker_bench.py --instructions                       # put/cycle 50x1, ours + floor
    python bench/broker_bench.py --instructions --pure --servers ours,floor,beanstalkd
    python bench/broker_bench.py --instructions --annotate 15         # also the top C functions

``--cache-sim`` adds callgrind's cache simulation: data references and first-level and
last-level data-cache misses per command. The last level simulated is the per-core L2 (on
the 2-core VMs, 512 KiB-1 MiB), not valgrind's default of the shared L3: what one server
process's working set at 500 connections spills is the question. A model, not the
hardware (no prefetcher), and the kernel is not in it; but it does not move with load.
The counts depend on the cache sizes, so two machines' counts compare only under one model:
``--cache-model 32K,8:512K,8`` simulates the AMD EPYC VM's D1 and L2 on any machine.

Writes bench/out/instructions.json.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import broker_bench as bb
import servers

WARMUP_OPS = 3000
TOTALS = re.compile(rb"^(?:totals|summary):\s*([\d ]+)$", re.MULTILINE)
EVENTS = re.compile(rb"^events:\s*(.+)$", re.MULTILINE)
L2_SIZE = Path("/sys/devices/system/cpu/cpu0/cache/index2/size")
L2_WAYS = Path("/sys/devices/system/cpu/cpu0/cache/index2/ways_of_associativity")


def l2_geometry() -> tuple[int, int]:
    """(bytes, ways) of this machine's per-core L2 cache; 512 KiB, 8 ways when sysfs does not say."""
    try:
        text = L2_SIZE.read_text().strip()
        size = int(text[:-1]) * 1024 if text.endswith("K") else int(text)
        ways = int(L2_WAYS.read_text().strip())
    except (OSError, ValueError):
        return 512 * 1024, 8
    # valgrind wants a power-of-two number of sets (size / (ways * 64))
    sets = size // (ways * 64)
    while sets & (sets - 1):
        sets &= sets - 1
    return sets * ways * 64, ways


def cache_model(spec: str | None) -> tuple[tuple[int, int] | None, tuple[int, int]]:
    """(D1, L2) geometries as (bytes, ways) from ``--cache-model D1,WAYS:L2,WAYS`` (sizes in bytes or with K / M);
    without it, no D1 (valgrind reads this machine's) and this machine's L2."""
    if spec is None:
        return None, l2_geometry()

    def one(part: str) -> tuple[int, int]:
        size_text, _, ways_text = part.partition(",")
        size_text = size_text.strip().upper()
        scale = {"K": 1024, "M": 1024 * 1024}.get(size_text[-1:], 1)
        size = int(size_text.rstrip("KM")) * scale
        ways = int(ways_text)
        sets = size // (ways * 64) if ways > 0 else 0
        if sets <= 0 or size % (ways * 64) or sets & (sets - 1):  # valgrind wants a power-of-two number of sets
            raise ValueError(f"{part!r}: the size must be a power-of-two number of {ways}-way sets of 64-byte lines")
        return size, ways

    d1_text, sep, l2_text = spec.partition(":")
    if not sep:
        raise ValueError(f"--cache-model {spec!r}: expected D1,WAYS:L2,WAYS, e.g. 32K,8:512K,8")
    return one(d1_text), one(l2_text)


def event_totals(text: bytes) -> dict[str, int]:
    """The callgrind file's largest totals line, by event name (Ir, and with --cache-sim Dr, D1mr...)."""
    names = EVENTS.search(text)
    rows = [[int(n) for n in m.split()] for m in TOTALS.findall(text)]
    if names is None or not rows:
        raise RuntimeError("no events or totals in the callgrind output")
    best = max(rows, key=lambda r: r[0])
    return dict(zip(names.group(1).decode().split(), best, strict=False))  # trailing zeros may be left out


def _control(pid: int, flag: str) -> None:
    res = subprocess.run(["callgrind_control", flag, str(pid)], capture_output=True, text=True, timeout=60, check=False)
    if res.returncode != 0 or "OK" not in res.stdout:
        raise RuntimeError(f"callgrind_control {flag} {pid} failed: {res.stdout.strip()} {res.stderr.strip()}")


def _loadgen_args(srv, workload: str, conns: int, depth: int, ops: int) -> list[str]:
    args = ["-h", srv.host, "-p", str(srv.port), "-s", "100", "-T", "bench", "-c", str(conns), "-d", str(depth)]
    if workload == "drain":  # reserve+delete of pre-filled jobs: fill first (counted separately, not measured)
        return args + ["-w", "drain", "-n", str(ops // 2)]
    return args + ["-w", workload, "-n", str(ops)]


def _await_line(proc: subprocess.Popen, pending: bytearray, want: bytes, deadline: float) -> None:
    """Read the load generator's stderr until the line ``want``, keeping what came before."""
    fd = proc.stderr.fileno()  # type: ignore[union-attr]
    while want + b"\n" not in pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"loadgen did not say {want.decode()!r} in time")
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"loadgen ended before {want.decode()!r}: {bytes(pending).decode(errors='replace')}")
            pending += chunk
    del pending[:pending.index(want + b"\n") + len(want) + 1]


def _stepped_loadgen(args: list[str], on_connected: Callable[[], None], on_finished: Callable[[], None],
                     timeout: float = 900) -> tuple[dict, float]:
    """Run the load generator with -S: ``on_connected`` once its connections are set up, ``on_finished`` after
    the last reply and before it closes them. Its JSON, and the seconds between the two."""
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen([str(bb.BIN), *args, "-S"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        pending = bytearray()
        _await_line(proc, pending, b"loadgen: connected", deadline)
        on_connected()
        started = time.monotonic()
        proc.stdin.write(b"go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        _await_line(proc, pending, b"loadgen: finished", deadline)
        on_finished()
        seconds = time.monotonic() - started
        out, err = proc.communicate(b"go\n", timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode().strip()
    if not text:
        raise RuntimeError(f"loadgen failed (rc={proc.returncode}): {(bytes(pending) + err).decode(errors='replace')}")
    return json.loads(text.splitlines()[-1]), seconds


def count(kind: str, workload: str, conns: int, depth: int, ops: int, opts, annotate: int = 0) -> dict:
    """Instructions per command of one server on one workload."""
    out_dir = bb.OUT / "callgrind"
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"{kind}_{workload}_c{conns}_d{depth}.out"
    proc = servers.server_process(kind, opts.ours_args, stderr_path=str(out_dir / f"{kind}.valgrind.log"),
                                  floor=opts.floor)
    cache = []
    if opts.cache_sim:
        d1, (size, ways) = cache_model(opts.cache_model)
        cache = ["--cache-sim=yes", f"--LL={size},{ways},64"]
        if d1 is not None:
            cache.append(f"--D1={d1[0]},{d1[1]},64")
    proc.argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}",
                 *cache, *proc.argv]
    srv = proc.start(timeout=180)  # Python starts ~50x slower under valgrind
    try:
        if workload == "drain":
            bb.run_loadgen(["-h", srv.host, "-p", str(srv.port), "-s", "100", "-T", "bench", "-w", "put", "-c", "1",
                            "-d", "64", "-n", str(ops // 2 + WARMUP_OPS)], None, timeout=900)
        bb.run_loadgen(_loadgen_args(srv, workload, conns, depth, WARMUP_OPS), None, timeout=900)
        data, seconds = _stepped_loadgen(_loadgen_args(srv, workload, conns, depth, ops),
                                         lambda: _control(srv.pid, "--instr=on"),
                                         lambda: _control(srv.pid, "--instr=off"))
    finally:
        srv.stop(timeout=60)
    events = event_totals(out_file.read_bytes())
    commands = data["ops"]
    result = {"server": kind, "workload": workload, "conns": conns, "depth": depth, "commands": commands,
              "instructions": events["Ir"], "per_command": events["Ir"] / commands if commands else None,
              "errors": data.get("errors", 0), "seconds_under_valgrind": round(seconds, 1),
              "callgrind_file": str(out_file)}
    if "D1mr" in events and commands:
        result["cache_per_command"] = {
            "data_refs": (events["Dr"] + events["Dw"]) / commands,
            "d1_misses": (events["D1mr"] + events["D1mw"]) / commands,
            "ll_misses": (events["DLmr"] + events["DLmw"]) / commands,
        }
    if annotate:
        result["top_functions"] = top_functions(out_file, annotate)
    return result


def top_functions(out_file: Path, n: int) -> list[str]:
    """callgrind_annotate's n most expensive functions (self instructions), as text lines."""
    if shutil.which("callgrind_annotate") is None:
        return []
    res = subprocess.run(["callgrind_annotate", "--threshold=99", str(out_file)], capture_output=True, text=True,
                         check=False, timeout=120)
    rows = [line for line in res.stdout.splitlines() if re.match(r"^\s*[\d,]+ \(", line)]
    return rows[1:n + 1]  # the first row is the program total


def _given(flag: str) -> bool:
    """Whether the command line names ``flag`` (the table's defaults differ from this mode's)."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in sys.argv[1:])


def main(opts) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (with callgrind_control) is needed: apt-get install -y valgrind", file=sys.stderr)
        return 2
    kinds = [k for k in opts.servers if k in ("ours", "ours-pure", "floor", "ceiling", "beanstalkd")]
    workloads = [w for w in opts.workloads if w in ("put", "cycle", "drain")]
    # Without the flag, the floor's two rows (put, cycle 50x1); a flag given is taken as it is,
    # even when it names the table's default (--depths 1,64).
    if not _given("--workloads"):
        workloads = ["put", "cycle"]
    conns = opts.conns if _given("--conns") else [50]
    depths = opts.depths if _given("--depths") else [1]
    try:
        d1_model, l2_model = cache_model(opts.cache_model)
    except ValueError as exc:
        print(f"--cache-model: {exc}", file=sys.stderr)
        return 2
    meta = {"machine": servers.machine(), "cache_sim": list(l2_model) if opts.cache_sim else None,
            "cache_d1": list(d1_model) if opts.cache_sim and d1_model else None,
            "builds": {k: servers.build_of_ours(k == "ours-pure") for k in kinds if k.startswith("ours")},
            "git": bb.git_info(), "ops": opts.instr_ops}
    print(f"# instructions per command (callgrind, user space); {bb.machine_line(meta)}", file=sys.stderr)
    results = []
    for workload in workloads:
        for c in conns:
            for d in depths:
                for kind in kinds:
                    if kind == "ceiling" and d > 1:
                        continue  # one command per packet only (bench/ceiling_server.py)
                    try:
                        r = count(kind, workload, c, d, opts.instr_ops, opts, annotate=opts.annotate)
                    except Exception as exc:  # noqa: BLE001 - a server that fails under valgrind is a result
                        r = {"server": kind, "workload": workload, "conns": c, "depth": d,
                             "failed": f"{type(exc).__name__}: {exc}"[:400]}
                    results.append(r)
                    cache = r.get("cache_per_command")
                    print(f"  {workload:5} {c}x{d} {kind:10} "
                          + (f"{r['per_command']:9.0f} instructions/command ({r['commands']} commands, "
                             f"{r['seconds_under_valgrind']} s)" if "per_command" in r else r["failed"])
                          + (f"; data refs {cache['data_refs']:.0f}, D1 misses {cache['d1_misses']:.1f}, "
                             f"L2 misses {cache['ll_misses']:.2f} a command" if cache else ""),
                          file=sys.stderr)
                    for line in r.get("top_functions", []):
                        print(f"      {line.strip()}", file=sys.stderr)
    print(table(results, kinds))
    if opts.cache_sim:
        print(cache_table(results, kinds))
        d1_text = f"D1 {d1_model[0] // 1024} KiB {d1_model[1]}-way" if d1_model else "this machine's D1"
        print(f"\ncaches simulated: {d1_text}, L2 {l2_model[0] // 1024} KiB {l2_model[1]}-way"
              + (" (--cache-model)" if opts.cache_model else " (this machine's)"))
    print(f"\n{bb.machine_line(meta)}; git {meta['git']['commit']}")
    out = bb.OUT / "instructions.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all("per_command" in r for r in results) else 1


def table(results: list[dict], kinds: list[str]) -> str:
    rows: dict[tuple, dict[str, float | None]] = {}
    for r in results:
        rows.setdefault((r["workload"], r["conns"], r["depth"]), {})[r["server"]] = r.get("per_command")
    ref = "floor" if "floor" in kinds else None
    hdr = ["workload", "conns x depth"] + [f"{k} instr/cmd" for k in kinds]
    hdr += [f"{k}/floor" for k in kinds if ref and k.startswith("ours")]
    lines = ["| " + " | ".join(hdr) + " |", "|---|---|" + "---:|" * (len(hdr) - 2)]
    for (w, c, d), per in rows.items():
        cells = [w, f"{c}x{d}"] + [f"{per[k]:,.0f}" if per.get(k) else "-" for k in kinds]
        for k in kinds:
            if ref and k.startswith("ours"):
                cells.append(f"{per[k] / per[ref]:.2f}" if per.get(k) and per.get(ref) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cache_table(results: list[dict], kinds: list[str]) -> str:
    """With --cache-sim: first-level and L2 data-cache misses per command, by row and server."""
    rows: dict[tuple, dict[str, dict]] = {}
    for r in results:
        if "cache_per_command" in r:
            rows.setdefault((r["workload"], r["conns"], r["depth"]), {})[r["server"]] = r["cache_per_command"]
    hdr = ["workload", "conns x depth"] + [f"{k} D1 / L2 misses per cmd" for k in kinds]
    lines = ["", "| " + " | ".join(hdr) + " |", "|---|---|" + "---:|" * len(kinds)]
    for (w, c, d), per in rows.items():
        cells = [w, f"{c}x{d}"] + [f"{per[k]['d1_misses']:.1f} / {per[k]['ll_misses']:.2f}" if k in per else "-"
                                   for k in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - run through broker_bench.py --instructions
    os.execv(sys.executable, [sys.executable, str(Path(__file__).with_name("broker_bench.py")), "--instructions",
                              *sys.argv[1:]])
