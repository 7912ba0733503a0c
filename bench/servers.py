"""The servers a benchmark row compares, and the machine it ran on.

Kinds:

* ``beanstalkd`` - the real beanstalkd 1.12;
* ``ours`` - our broker as installed: the mypyc-compiled core when it was built, else
  the interpreted code (``build_of_ours()`` says which);
* ``ours-pure`` - our broker with ``SPARK_BEANSTALK_PURE=1`` (interpreted code even
  when compiled modules exist);
* ``floor`` - ``shared/tools/python_floor.py``: asyncio + uvloop and nothing else
  (no priorities, timers, stats or error paths). The least any Python server costs.
* ``ceiling`` - ``bench/ceiling_server.py``: asyncio + uvloop answering the load generator
  with no jobs kept at all (a count): what no Python server on this stack can beat.
* ``wire`` - ``bench/wire_server.c``: a C server that frames the load generator's commands
  and answers each with a constant reply, busy polling and holding a poll's replies as our
  compiled broker does. Its throughput is the most the load generator can drive on this
  machine: on 2 cores the generator pays about as much kernel time a command as the server,
  so a server cheaper than the generator shows the generator's rate, not its own.

Ratios between these move from machine to machine (CPU, kernel, Python build): always
compare servers measured in the same run, on the same machine.
"""
from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from spark_beanstalk.embedded import (
    ServerProcess,
    beanstalkd_process,
    broker_process,
    free_port,
)

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
KINDS = ("beanstalkd", "ours", "ours-pure", "floor", "ceiling", "wire")
CEILING = BENCH / "ceiling_server.py"
WIRE_SRC = BENCH / "wire_server.c"
WIRE_BIN = BENCH / "bin" / "wire_server"
FLOOR_ENV = "SPARK_BEANSTALK_FLOOR"
PURE_ENV = "SPARK_BEANSTALK_PURE"
FLOOR_REL = Path("shared") / "tools" / "python_floor.py"


class FloorMissing(RuntimeError):
    """The floor server script is not where the benchmark looks for it."""


def floor_candidates(explicit: str | None = None) -> list[Path]:
    """Where the floor server may be: --floor, else $SPARK_BEANSTALK_FLOOR (either one alone:
    a path given is the path meant), else shared/tools/ beside the repository or beside any
    directory above it (CI clones shared/ next to the repo; a git worktree sits deeper)."""
    given = explicit or os.environ.get(FLOOR_ENV)
    if given:
        return [Path(given)]
    return [parent / FLOOR_REL for parent in ROOT.parents]


def floor_script(explicit: str | None = None) -> Path:
    candidates = floor_candidates(explicit)
    for path in candidates:
        if path.is_file():
            return path.resolve()
    looked = "\n  ".join(str(p) for p in candidates)
    raise FloorMissing(f"the floor server (python_floor.py) was not found; looked in:\n  {looked}\n"
                       f"pass --floor PATH, set {FLOOR_ENV}, or leave `floor` out of --servers")


def build_c(src: Path, out: Path, force: bool = False) -> Path:
    """Compile one of the bench's C programs (the load generator, the wire server) into
    bench/bin/ if missing or older than its source."""
    if not force and out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError(f"no C compiler (gcc) found to build {src.relative_to(ROOT)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    subprocess.run([cc, "-O2", "-Wall", "-o", str(tmp), str(src)], check=True)
    os.replace(tmp, out)
    return out


def _env(pure: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(PURE_ENV, None)
    if pure:
        env[PURE_ENV] = "1"
    pythonpath = env.get("PYTHONPATH", "")
    if str(ROOT) not in pythonpath.split(os.pathsep):  # the tree being benchmarked, not an install elsewhere
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), pythonpath) if p)
    return env


def server_process(kind: str, ours_args: list[str], stderr_path: str | None = None,
                   floor: str | None = None) -> ServerProcess:
    """A not-yet-started ServerProcess of one kind."""
    if kind == "beanstalkd":
        return beanstalkd_process(stderr_path=stderr_path)
    if kind in ("ours", "ours-pure"):
        return broker_process(extra_args=ours_args, stderr_path=stderr_path, env=_env(kind == "ours-pure"))
    if kind == "floor":
        port = free_port()
        return ServerProcess(argv=[sys.executable, str(floor_script(floor)), str(port)], host="127.0.0.1",
                             port=port, env=_env(False), stderr_path=stderr_path)
    if kind == "ceiling":
        port = free_port()
        return ServerProcess(argv=[sys.executable, str(CEILING), str(port)], host="127.0.0.1",
                             port=port, env=_env(False), stderr_path=stderr_path)
    if kind == "wire":
        port = free_port()
        return ServerProcess(argv=[str(build_c(WIRE_SRC, WIRE_BIN)), str(port)], host="127.0.0.1",
                             port=port, stderr_path=stderr_path)
    raise ValueError(f"unknown server kind {kind!r} (one of {', '.join(KINDS)})")


def cpu_model() -> str:
    """The CPU's name, with family, model, stepping, clock and cache size from /proc/cpuinfo.

    A VM often shows only "AMD EPYC": three different parts (Zen 3, 4 and 5) have run this bench
    under that name, and ratios differ between them, so the figures need the numbers too.
    """
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    return describe_cpuinfo(text) or platform.processor() or platform.machine()


def describe_cpuinfo(text: str) -> str:
    """`model name (family F model M stepping S, N MHz, cache K KB)` from the first CPU in a cpuinfo text."""
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "")
    if not name:
        return ""
    ident = " ".join(f"{label} {fields[key]}" for key, label in
                     (("cpu family", "family"), ("model", "model"), ("stepping", "stepping")) if key in fields)
    parts = [ident] if ident else []
    with contextlib.suppress(KeyError, ValueError):
        parts.append(f"{float(fields['cpu MHz']):.0f} MHz")
    if fields.get("cache size"):
        parts.append(f"cache {fields['cache size']}")
    return f"{name} ({', '.join(parts)})" if parts else name


def python_build() -> str:
    try:
        import uvloop
        loop = f"uvloop {uvloop.__version__}"
    except ImportError:
        loop = "no uvloop"
    return (f"{platform.python_implementation()} {platform.python_version()} "
            f"({platform.python_compiler()}), {loop}")


def build_of_ours(pure: bool = False) -> str:
    """What `ours` (or `ours-pure`) runs: asked of a fresh interpreter with the bench's env."""
    code = "from broker import _build, netio; print(_build.describe() + '; client sockets: ' + netio.status()[1])"
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=_env(pure), cwd=ROOT, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return res.stdout.strip() or f"unknown ({res.stderr.strip()[-200:]})"


def machine() -> dict:
    return {"cpu_model": cpu_model(), "nproc": os.cpu_count(), "python": python_build(),
            "kernel": platform.release(), "loadavg": os.getloadavg()}
