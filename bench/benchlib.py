"""What the bench scripts share: their paths, the repository on sys.path, broker_bench's helpers,
the JSON file each writes.

Each script runs as `python bench/NAME.py`, so this directory is first on sys.path and
`import benchlib` finds this module; importing it puts the repository root there too, so
the scripts then import `spark_beanstalk` and `broker` from the checkout.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
OUT = BENCH / "out"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def broker_bench() -> ModuleType:
    """bench/broker_bench.py as a module: machine facts, load generator, tables."""
    spec = importlib.util.spec_from_file_location("broker_bench", BENCH / "broker_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_json(path: str | Path, data: object) -> Path:
    """A script's results as JSON at ``path`` (its directory made if missing); values JSON cannot hold
    (paths, times) written as their str."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str))
    return out
