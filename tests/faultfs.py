"""A FUSE pass-through file system that fails on command: real I/O errors for the binlog tests.

``python tests/faultfs.py BACKING MOUNT CONTROL`` mounts BACKING at MOUNT (foreground; it
serves until unmounted or killed). Each operation looks at the flag files in CONTROL (a
directory outside the mount), so a test turns a fault on or off by creating or removing one:

* ``fail-write``: every ``write`` fails with EIO;
* ``fail-fsync``: every ``fsync``/``fdatasync`` of a file fails with EIO, and the data written to
  that file since its last successful fsync is lost, as the kernel drops the dirty pages of a
  failed writeback (a retried fsync then reports success over data that is not there);
* ``fail-unlink`` / ``fail-rename``: unlinking / renaming a file whose path contains the flag
  file's text fails with EIO;
* ``power-cut``: every file loses what was written since its last successful fsync, then every
  operation fails with EIO until the flag is removed (the disk went away with the power). If
  the flag file holds a number, it seeds a random choice instead: each 4 KiB page that unsynced
  writes touched is lost (back to what it held at the last fsync) or kept with even odds, as
  writeback may have reached the disk for some pages of a file and not for others, in any order.
  ``alternate`` loses every other page of each file (the first one lost): the same shape, for
  certain. ``kept`` loses nothing written (writeback finished; the fsync's reply did not come);
* ``power-cut-at-fsync``: the power cut above (the flag's text chooses the same way), at the next
  ``fsync`` of a file: after the broker's writes of a batch, before it learns that they are durable.

Only file data is modelled: creating, renaming and unlinking files take effect at once. The
undo log (the bytes each unsynced write replaced) is what makes the loss exact: a lost write
reads back as whatever the file held before it, zeros in allocated space.
"""

from __future__ import annotations

import errno
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import mfusepy  # type: ignore[import-untyped]

PAGE = 4096
# utimensat(2)'s markers in a timespec's nanoseconds: "now" and "leave as it is"
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2


class Kept:
    """Every unsynced page reached the disk (``random() < 0.5`` means kept)."""

    def random(self) -> float:
        return 0.0


class Alternate:
    """A coin that alternates: lost, kept, lost... (``random() < 0.5`` means kept)."""

    turn = 1.0

    def random(self) -> float:
        self.turn = 0.0 if self.turn else 1.0
        return 1.0 - self.turn


_PICKS: dict[str, type[Alternate] | type[Kept]] = {"alternate": Alternate, "kept": Kept}


@dataclass
class Undo:
    """What one file's unsynced writes replaced: (offset, old bytes) in write order, and its size before.

    ``old`` is as long as the write: bytes past the end of the file count as zeros."""

    size: int
    writes: list[tuple[int, bytes]] = field(default_factory=list)


class FaultFS(mfusepy.Operations):  # type: ignore[misc]
    """Pass-through to ``root`` with the faults of the module docstring."""

    use_ns = True  # mfusepy: file times in integer nanoseconds, so that utimens sees UTIME_NOW / UTIME_OMIT

    def __init__(self, root: str, control: str) -> None:
        self.root = os.path.realpath(root)
        self.control = control
        self.undo: dict[str, Undo] = {}
        self.mutex = threading.Lock()
        self.cut = False

    # -- faults --------------------------------------------------------------------------
    def _flag(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.control, name))

    def _matches(self, name: str, path: str) -> bool:
        """Whether the flag ``name`` is on and its text is part of ``path``."""
        try:
            with open(os.path.join(self.control, name)) as fh:
                return fh.read() in path
        except FileNotFoundError:
            return False

    def _check_power(self) -> None:
        flag = os.path.join(self.control, "power-cut")
        if os.path.exists(flag):
            if not self.cut:
                with open(flag) as fh:
                    seed = fh.read().strip()
                pick: random.Random | Alternate | Kept | None = None
                if seed in _PICKS:
                    pick = _PICKS[seed]()
                elif seed:
                    pick = random.Random(int(seed))
                with self.mutex:
                    for path in sorted(self.undo):
                        self._lose(path, pick)
                self.cut = True
            raise mfusepy.FuseOSError(errno.EIO)
        self.cut = False

    def _lose(self, path: str, pick: random.Random | Alternate | Kept | None = None) -> None:
        """Put back what the unsynced writes of ``path`` replaced (caller holds the lock); with
        ``pick``, only in a random half of the pages they touched."""
        undo = self.undo.pop(path, None)
        if undo is None:
            return
        fd = os.open(self._full(path), os.O_RDWR)
        try:
            if pick is None:
                for offset, old in reversed(undo.writes):
                    os.pwrite(fd, old, offset)
                if os.fstat(fd).st_size > undo.size:
                    os.ftruncate(fd, undo.size)
                return
            if isinstance(pick, Alternate):
                pick.turn = 1.0  # each file starts with a lost page
            pages = sorted({p for offset, old in undo.writes
                            for p in range(offset // PAGE, (offset + len(old) - 1) // PAGE + 1)})
            for page in pages:
                if pick.random() < 0.5:
                    continue  # this page reached the disk
                lo = page * PAGE
                image = bytearray(os.pread(fd, PAGE, lo))
                for offset, old in reversed(undo.writes):
                    a, b = max(offset, lo), min(offset + len(old), lo + len(image))
                    if a < b:
                        image[a - lo:b - lo] = old[a - offset:b - offset]
                os.pwrite(fd, image, lo)
        finally:
            os.close(fd)

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    # -- files ---------------------------------------------------------------------------
    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        self._check_power()
        st = os.lstat(self._full(path))
        fields = {key: getattr(st, key) for key in ("st_blocks", "st_gid", "st_mode", "st_nlink", "st_size", "st_uid")}
        # times in nanoseconds (use_ns)
        return fields | {"st_atime": st.st_atime_ns, "st_ctime": st.st_ctime_ns, "st_mtime": st.st_mtime_ns}

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def readdir(self, path: str, fh: int) -> list[str]:
        self._check_power()
        return [".", "..", *os.listdir(self._full(path))]

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._full(path))
        return {key: getattr(st, key) for key in (
            "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
            "f_frsize", "f_namemax")}

    def mkdir(self, path: str, mode: int) -> int:
        self._check_power()
        os.mkdir(self._full(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._check_power()
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        self._check_power()
        if self._matches("fail-unlink", path):
            raise mfusepy.FuseOSError(errno.EIO)
        with self.mutex:
            self.undo.pop(path, None)
        os.unlink(self._full(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        self._check_power()
        if self._matches("fail-rename", old):
            raise mfusepy.FuseOSError(errno.EIO)
        with self.mutex:
            undo = self.undo.pop(old, None)
            if undo is not None:
                self.undo[new] = undo
        os.rename(self._full(old), self._full(new))
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        """(atime, mtime) in nanoseconds (use_ns), either of them possibly UTIME_NOW or UTIME_OMIT as the kernel
        sent it (``touch``: both UTIME_NOW); None: now."""
        full = self._full(path)
        if times is None:
            os.utime(full)
            return 0
        now, st = time.time_ns(), os.lstat(full)

        def resolved(given: int, current: int) -> int:
            return now if given == UTIME_NOW else current if given == UTIME_OMIT else given

        os.utime(full, ns=(resolved(times[0], st.st_atime_ns), resolved(times[1], st.st_mtime_ns)))
        return 0

    def create(self, path: str, mode: int, fi: object = None) -> int:
        self._check_power()
        return os.open(self._full(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)  # read: the undo log

    def open(self, path: str, flags: int) -> int:
        self._check_power()
        return os.open(self._full(path), (flags & ~(os.O_APPEND | os.O_ACCMODE)) | os.O_RDWR)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        self._check_power()
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._check_power()
        if self._flag("fail-write"):
            raise mfusepy.FuseOSError(errno.EIO)
        with self.mutex:
            undo = self.undo.get(path)
            if undo is None:
                undo = self.undo[path] = Undo(os.fstat(fh).st_size)
            old = os.pread(fh, len(data), offset)
            undo.writes.append((offset, old + bytes(len(data) - len(old))))
            return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._check_power()
        with open(self._full(path), "r+b") as f:
            f.truncate(length)
        return 0

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
        self._check_power()
        os.posix_fallocate(fh, offset, size)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        if self._flag("power-cut-at-fsync"):
            os.replace(os.path.join(self.control, "power-cut-at-fsync"), os.path.join(self.control, "power-cut"))
        self._check_power()
        with self.mutex:
            if self._flag("fail-fsync"):
                self._lose(path)
                raise mfusepy.FuseOSError(errno.EIO)
            self.undo.pop(path, None)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        self._check_power()
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0


def main(argv: list[str]) -> None:
    backing, mount, control = argv
    mfusepy.FUSE(FaultFS(backing, control), mount, foreground=True, nothreads=True)


if __name__ == "__main__":
    main(sys.argv[1:])
