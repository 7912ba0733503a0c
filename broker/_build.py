"""Which build of the broker's hot modules runs: mypyc-compiled or interpreted.

``setup.py`` compiles :data:`HOT_MODULES` with mypyc when the machine has a C compiler
(``SPARK_BEANSTALK_NO_COMPILE=1`` skips it); the extension modules land beside the
``.py`` files, and Python's import system prefers them. The interpreted source is used
instead, for every hot module at once, when

* ``SPARK_BEANSTALK_PURE=1`` asks for it (CI runs the protocol suites both ways), or
* the compiled set is incomplete or older than its source (an edited checkout): a stale
  extension would silently run old code, and a compiled module cannot mix with an
  interpreted one of the same group (mypyc's native classes check their exact types).

:func:`select` runs from ``broker/__init__.py``, before any hot module is imported.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PURE_ENV = "SPARK_BEANSTALK_PURE"
NO_COMPILE_ENV = "SPARK_BEANSTALK_NO_COMPILE"
GROUP = "broker"  # mypyc's shared library is <GROUP>__mypyc beside the package
# The modules setup.py compiles (the per-command path, and the binlog's per-record work:
# its format, and recovery, which restores a million jobs at start); everything else stays interpreted.
HOT_MODULES: tuple[str, ...] = ("broker.protocol", "broker.timers", "broker.jobtable", "broker.model", "broker.queue",
                               "broker.queue_verbs", "broker.queue_timers", "broker.state", "broker.busypoll",
                               "broker.connection", "broker.stats", "broker.binlog_format", "broker.queue_restore",
                               "broker.binlog_recovery", "broker.limits", "broker.binlog_segments", "broker.binlog",
                               "broker.queue_apply", "broker.replication.wire", "broker.replication.source",
                               "broker.replication.follower", "broker.replication.fanout")
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Selection:
    """The outcome of :func:`select`: ``compiled`` and a reason a person can read."""

    compiled: bool
    reason: str
    modules: tuple[str, ...] = ()


class SourceFirst(importlib.abc.MetaPathFinder):
    """Finds the hot modules' ``.py`` files, ahead of the extension modules beside them."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        return importlib.util.spec_from_file_location(fullname, _source(fullname))


def _source(module: str) -> Path:
    return PACKAGE_DIR.parent.joinpath(*module.split(".")).with_suffix(".py")


def extension(module: str) -> Path | None:
    """The extension file of a module of this package (a hot module's, or broker._netio's), if built."""
    stem = PACKAGE_DIR.parent.joinpath(*module.split("."))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = stem.with_name(stem.name + suffix)
        if path.exists():
            return path
    return None


def _group_library() -> Path | None:
    """The mypyc group library the compiled modules load, if this process can import it.

    It sits beside the package, which is not always on ``sys.path`` (an editable install
    maps the packages only): then the extension modules exist but cannot load."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = PACKAGE_DIR.parent / f"{GROUP}__mypyc{suffix}"
        if path.exists():
            spec = importlib.util.find_spec(f"{GROUP}__mypyc")
            return path if spec is not None and spec.origin and Path(spec.origin).resolve() == path else None
    return None


def env_flag(name: str, default: bool = False) -> bool:
    """An on/off switch from the environment: unset or blank is ``default``; 0, false, no are off."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ("0", "false", "no")


def older_than_source(ext: Path, source: Path) -> bool:
    """A built extension older than its source would silently run old code (an edited checkout)."""
    return source.exists() and source.stat().st_mtime > ext.stat().st_mtime


def inspect_build() -> Selection:
    """What select() would decide, without changing anything."""
    built = {m: extension(m) for m in HOT_MODULES}
    present = [m for m, ext in built.items() if ext is not None]
    if not present:
        return Selection(False, "interpreted (no compiled modules built)")
    if env_flag(PURE_ENV):
        return Selection(False, f"interpreted ({PURE_ENV}=1)")
    missing = [m for m in HOT_MODULES if built[m] is None]
    if missing or _group_library() is None:
        return Selection(False, f"interpreted (compiled set incomplete: {', '.join(missing) or 'group library'})")
    stale = [m for m, ext in built.items() if ext is not None and older_than_source(ext, _source(m))]
    if stale:
        return Selection(False, f"interpreted (compiled modules older than their source: {', '.join(stale)}; "
                                f"rebuild with `python setup.py build_ext --inplace`)")
    return Selection(True, "compiled (mypyc)", tuple(HOT_MODULES))


def select() -> Selection:
    """Make the decision for this process; called once, before the hot modules load."""
    choice = inspect_build()
    if not choice.compiled and any(extension(m) for m in HOT_MODULES):
        if not any(isinstance(f, SourceFirst) for f in sys.meta_path):
            sys.meta_path.insert(0, SourceFirst(HOT_MODULES))
        if "stale" in choice.reason or "incomplete" in choice.reason or "older" in choice.reason:
            print(f"spark-beanstalk: broker core {choice.reason}", file=sys.stderr)
    return choice


def is_compiled_file(module_file: str) -> bool:
    """Is a module with this ``__file__`` an extension module (the compiled build)? A hot
    module asks this about itself where the two builds are best served by different code."""
    return module_file.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def running() -> Selection:
    """What this process actually runs (after the hot modules were imported)."""
    compiled = [m for m in HOT_MODULES if m in sys.modules
                and is_compiled_file(str(getattr(sys.modules[m], "__file__", "")))]
    if compiled:
        names = ", ".join(m.removeprefix("broker.") for m in compiled)
        return Selection(True, f"compiled (mypyc): {names}", tuple(compiled))
    return inspect_build() if not inspect_build().compiled else Selection(False, "interpreted")


@functools.cache
def core_name() -> str:
    """The core this process runs, "compiled" or "interpreted" (the start-up log, every metrics scrape:
    it cannot change once the hot modules are imported)."""
    return "compiled" if running().compiled else "interpreted"


def describe() -> str:
    """One line for benchmarks and logs: which build the hot modules of this process run."""
    for module in HOT_MODULES:
        importlib.import_module(module)
    return running().reason
