"""The binlog's files (beanstalkd's file.c): the directory, one segment file, the fsync thread.

Everything here is about *files*: creating and allocating a segment, reading one whole,
truncating it, locking the directory, fsyncing the directory after a create or unlink.
Which segments exist and which jobs live where is :mod:`broker.binlog`; reading records
back is :mod:`broker.binlog_recovery`; the bytes of a record are :mod:`broker.binlog_format`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from broker import binlog_format as fmt

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
CRASH_ENV = "SPARK_BEANSTALK_BINLOG_CRASH"


class BinlogError(Exception):
    """The binlog cannot be opened as it is (damage, lock held, unreadable): do not start."""


def say(message: str) -> None:
    """Recovery reports and warnings: always on stderr, whatever the log level."""
    try:
        sys.stderr.write(f"binlog: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class CrashHook:
    """Test hook: kill this process (SIGKILL) the n-th time it reaches a named point.

    ``"point:n"`` (tests/test_binlog_crash.py sets it through the environment of a broker
    process, see :meth:`from_env`) crashes at every step of a segment switch and of
    compaction. A Binlog without one never crashes on purpose.
    """

    __slots__ = ("count", "hits", "point")

    def __init__(self, point: str, count: int = 1) -> None:
        self.point = point
        self.count = count
        self.hits = 0

    @classmethod
    def parse(cls, spec: str | None) -> CrashHook | None:
        if not spec:
            return None
        name, _, count = spec.partition(":")
        if not (count or "1").isdigit():
            raise BinlogError(f"{CRASH_ENV}={spec!r}: expected POINT or POINT:N (N a count)")
        return cls(name, int(count or 1))

    @classmethod
    def from_env(cls) -> CrashHook | None:
        return cls.parse(os.environ.get(CRASH_ENV))

    def reached(self, name: str) -> None:
        if name == self.point:
            self.hits += 1
            if self.hits >= self.count:
                os.kill(os.getpid(), signal.SIGKILL)


class BinlogDir:
    """The binlog directory: its lock, its segment files by index, and fsyncs of the directory."""

    def __init__(self, path: str, crash: CrashHook | None = None) -> None:
        self.path = os.path.abspath(path)
        self.crash = crash
        self._dirfd = -1
        self._lockfd = -1

    def open(self) -> None:
        """Create the directory if needed and lock it (one broker per directory, as beanstalkd)."""
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise BinlogError(f"cannot create binlog directory {self.path}: {exc.strerror}") from None
        if not os.path.isdir(self.path):
            raise BinlogError(f"binlog path {self.path} is not a directory")
        lock = os.path.join(self.path, "lock")
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise BinlogError(f"cannot open {lock}: {exc.strerror}") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise BinlogError(f"cannot lock {lock}: {exc.strerror} (the binlog directory must be on a "
                                  f"file system with POSIX locks)") from None
            raise BinlogError(f"binlog directory {self.path} is in use by another process "
                              f"(lock {lock} is held)") from None
        self._lockfd = fd
        self._dirfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        self.settle()

    def crash_point(self, name: str) -> None:
        if self.crash is not None:
            self.crash.reached(name)

    def segment(self, idx: int) -> str:
        return os.path.join(self.path, fmt.segment_name(idx))

    def indexes(self) -> list[int]:
        """Indexes of the segment files present, ascending."""
        return sorted(i for i in (fmt.parse_segment_name(n) for n in os.listdir(self.path)) if i is not None)

    def highest_index(self) -> int:
        """The highest segment index on disk, set-aside (``*.damaged``) files and bases included."""
        best = 0
        for name in os.listdir(self.path):
            for suffix in (".damaged", fmt.PARTIAL_SUFFIX, fmt.BASE_SUFFIX):
                name = name.removesuffix(suffix)
            idx = fmt.parse_segment_name(name)
            if idx is not None:
                best = max(best, idx)
        return best

    def settle(self) -> None:
        """At open, before reading: finish or forget a base that a crash interrupted.

        A ``*.partial`` base was not complete (it was renamed once fsynced): it goes, and
        the segments it was to replace are read. A ``*.base`` is complete and replaces every
        segment with a lower index (they may hold records a failed fsync lost, and so old
        puts without their deletes): those go, then it becomes a plain segment.
        """
        names = os.listdir(self.path)
        bases = [i for i in (fmt.parse_state_name(n, fmt.BASE_SUFFIX) for n in names) if i is not None]
        changed = False
        for name in names:
            idx = fmt.parse_state_name(name, fmt.PARTIAL_SUFFIX)
            if idx is None and bases:
                idx = fmt.parse_segment_name(name)
                if idx is not None and idx >= max(bases):
                    idx = None
            if idx is not None:
                os.unlink(os.path.join(self.path, name))
                changed = True
        if bases:
            top = max(bases)
            for idx in bases:
                path = self.segment(idx) + fmt.BASE_SUFFIX
                if idx < top:
                    os.unlink(path)
                else:
                    os.replace(path, self.segment(idx))
            say(f"finished the base {fmt.segment_name(top)} a restart interrupted; older segments removed")
            changed = True
        if changed:
            self.fsync()

    def commit_base(self, idx: int) -> None:
        """The fsynced ``*.partial`` base becomes ``*.base``: from here it replaces every lower segment."""
        os.replace(self.segment(idx) + fmt.PARTIAL_SUFFIX, self.segment(idx) + fmt.BASE_SUFFIX)
        self.fsync()
        self.crash_point("base-committed")

    def finish_base(self, idx: int) -> None:
        """Every lower segment is gone: the base becomes a plain segment."""
        os.replace(self.segment(idx) + fmt.BASE_SUFFIX, self.segment(idx))
        self.fsync()

    def fsync(self) -> None:
        if self._dirfd >= 0:
            os.fsync(self._dirfd)
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, idx: int) -> None:
        """Unlink a segment, under its plain or its *.base name (missing is fine); durable only
        after the next :meth:`fsync`."""
        for suffix in ("", fmt.BASE_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.segment(idx) + suffix)

    def remove(self, idx: int) -> None:
        """Unlink a segment and make that durable."""
        self.unlink(idx)
        self.fsync()

    def set_aside(self, idx: int) -> str:
        """--binlog-ignore-damage: keep a damaged segment as ``*.damaged``; returns the new name."""
        path = self.segment(idx)
        if os.path.exists(path):
            os.replace(path, path + ".damaged")
            self.fsync()
        return path + ".damaged"

    def create_segment(self, idx: int, want: int, minimum: int, suffix: str = "") -> tuple[int, int]:
        """Create segment file ``idx`` (``+ suffix``) with ``want`` bytes allocated (or at least ``minimum``).

        Returns (fd, allocated) or (-1, 0) when the disk has no room. The file and its
        directory entry are made durable before anything is written into it.
        """
        path = self.segment(idx) + suffix
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                return -1, 0
            raise
        alloc = 0
        for size in (want, minimum) if minimum < want else (want,):
            try:
                os.posix_fallocate(fd, 0, size)
                alloc = size
                break
            except OSError as exc:
                if exc.errno not in FULL_ERRNOS:
                    self._discard(fd, path)
                    raise
        if not alloc:
            self._discard(fd, path)
            return -1, 0
        try:
            os.fsync(fd)
            self.fsync()
        except OSError:
            self._discard(fd, path)
            raise
        self.crash_point("segment-created")
        return fd, alloc

    def _discard(self, fd: int, path: str) -> None:
        """A segment that could not be made ready: no descriptor or file left behind."""
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def abandon(self) -> None:
        """For tests: let go of the directory as SIGKILL would (no fsync)."""
        for fd in (self._dirfd, self._lockfd):
            if fd >= 0:
                os.close(fd)
        self._dirfd = self._lockfd = -1

    def close(self) -> None:
        if self._dirfd >= 0:
            try:
                os.fsync(self._dirfd)
            finally:
                os.close(self._dirfd)
                self._dirfd = -1
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1


def read_file(path: str) -> bytes:
    with open(path, "rb", buffering=0) as fh:
        return fh.read()


def truncate_file(path: str, size: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, buf: bytearray) -> None:
    """Write the whole buffer (one os.write, normally) and empty it.

    On an error, what was written is removed from ``buf`` before the OSError propagates, so
    that a later retry writes only the rest.
    """
    n = len(buf)
    done = 0
    try:
        done = os.write(fd, buf)
        if done < n:
            with memoryview(buf) as mv:
                while done < n:
                    done += os.write(fd, mv[done:])
    except OSError:
        if done:
            del buf[:done]
        raise
    buf.clear()


class FsyncThread:
    """``-f MS``: fdatasync at most every MS ms while there is unsynced data.

    ``os.fdatasync`` releases the GIL, so the event loop keeps serving meanwhile. The
    writer calls :meth:`wake` after each write; ``sync`` is the Binlog's locked fdatasync
    of whatever is dirty.
    """

    def __init__(self, interval_ms: int, sync: Callable[[], None]) -> None:
        self.interval = interval_ms / 1000.0
        self._sync = sync
        self.wake_event = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="binlog-fsync", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def wake(self) -> None:
        if not self.wake_event.is_set():
            self.wake_event.set()

    def _stopped(self) -> bool:
        """Another thread sets ``stopping``: a call, so each check reads it afresh (for mypy too)."""
        return self.stopping

    def stop(self) -> None:
        self.stopping = True
        self.wake_event.set()
        self.thread.join(5)

    def _loop(self) -> None:
        last = 0.0
        wake = self.wake_event
        while True:
            wake.wait()
            if self._stopped():
                return
            wait = last + self.interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            wake.clear()
            if self._stopped():  # stop() may have set the event just before clear(): close syncs itself
                return
            try:
                self._sync()
            except OSError as exc:
                say(f"ERROR: fdatasync failed: {exc.strerror}")
            last = time.monotonic()
