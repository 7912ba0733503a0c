"""Which broker core a process runs: a compiled set it cannot load must fall back, not crash."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The broker package reached through a directory that is not the repository root, with every
# other route to the repository (its root on sys.path, an editable install's finder) removed.
_PROBE = """
import sys
from pathlib import Path
repo = Path({repo!r})
sys.path[:] = [{alias!r}] + [p for p in sys.path if p and Path(p).resolve() != repo]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")).lower()]
import broker._build as build
print(build.inspect_build().reason)
import broker.protocol, broker.queue
print(broker.protocol.__file__)
"""


def test_group_library_off_sys_path_runs_interpreted(tmp_path: Path) -> None:
    """The extension modules sit beside the sources, but the mypyc group library they load is in
    the repository root: when the root is not importable (an editable install that maps the
    packages only), the broker must run interpreted instead of failing at its first import."""
    alias = tmp_path / "alias"
    alias.mkdir()
    for package in ("broker", "beanstalk_rules"):
        (alias / package).symlink_to(REPO / package)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPARK_BEANSTALK_PURE")}
    res = subprocess.run([sys.executable, "-c", _PROBE.format(repo=str(REPO), alias=str(alias))],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    reason, module_file = res.stdout.split("\n")[:2]
    assert reason.startswith("interpreted"), reason
    assert module_file.endswith(".py")
    if any(REPO.glob("broker__mypyc.*")):
        assert "group library" in reason


def test_every_hot_module_maps_to_its_source_and_extension() -> None:
    """Hot modules in a subpackage (broker.replication.wire) are found where setup.py builds them:
    the staleness check compares each extension with its own source, not a same-named file."""
    from broker import _build

    compiled = any(REPO.glob("broker__mypyc.*"))
    for module in _build.HOT_MODULES:
        source = _build._source(module)
        assert source == REPO.joinpath(*module.split(".")).with_suffix(".py") and source.exists(), module
        if compiled:
            ext = _build.extension(module)
            assert ext is not None and ext.parent == source.parent and ext.name.startswith(source.stem + "."), module
