"""Compiles the broker's hot modules with mypyc where a C compiler is present, and beside them
the client sockets' C transport (broker/_netio.c; broker/netio.py says when it is used).

Everything else (metadata, dependencies) is in pyproject.toml. The compile is optional:
without mypy, without a C compiler, or with SPARK_BEANSTALK_NO_COMPILE=1 the package
installs as plain Python and runs the same source interpreted (broker/_build.py picks
the build at run time; SPARK_BEANSTALK_PURE=1 forces the interpreted one).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _build_module():
    spec = importlib.util.spec_from_file_location("_broker_build", ROOT / "broker" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class OptionalBuildExt(build_ext):
    """A failed C compile leaves the interpreted package, never a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - no compiler, missing headers: the pure build still works
            print(f"spark-beanstalk: compiling the broker core failed ({exc}); using interpreted code",
                  file=sys.stderr)
            return
        # An unchanged module is copied, not rebuilt, keeping its old time; broker/_build.py
        # treats an extension older than its source as stale, so mark what this build checked.
        for ext in self.extensions:
            path = Path(self.get_ext_fullpath(ext.name))
            if path.exists():
                os.utime(path)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - one failed extension must not fail the install
            print(f"spark-beanstalk: compiling {ext.name} failed ({exc}); using interpreted code", file=sys.stderr)


def ext_modules() -> list:
    build = _build_module()
    if os.environ.get(build.NO_COMPILE_ENV, "").strip() not in ("", "0"):
        print(f"spark-beanstalk: {build.NO_COMPILE_ENV} set, broker core stays interpreted", file=sys.stderr)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("spark-beanstalk: mypyc not available, broker core stays interpreted", file=sys.stderr)
        return []
    sources = [str(Path(*m.split(".")).with_suffix(".py")) for m in build.HOT_MODULES]
    # The client sockets' C transport (broker/netio.py uses it only beside the compiled core).
    netio = Extension("broker._netio", ["broker/_netio.c"])
    try:
        return [*mypycify(sources, opt_level="3", group_name=build.GROUP), netio]
    except BaseException as exc:  # noqa: BLE001 - mypyc exits on type errors: never block the install
        print(f"spark-beanstalk: mypyc could not compile the broker core ({exc!r}); using interpreted code",
              file=sys.stderr)
        return []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
