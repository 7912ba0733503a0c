"""The long fuzz run (bench/fuzz_long.py): >= 1,000,000 generated and mutated inputs over
many connections against a live broker with every issue-7 limit and token auth on; then
zero crashes, zero leaked connections, RSS back near its baseline.

The full run is marked slow (CI deselects it with -m "not slow"); a --quick smoke run
keeps the script itself from rotting.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "fuzz_long.py"


def _run(tmp_path: Path, *args: str, timeout: float) -> dict:
    out = tmp_path / "fuzz.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    assert out.exists(), f"no summary written (rc={res.returncode}):\n{res.stderr[-3000:]}"
    summary = json.loads(out.read_text())
    assert res.returncode == 0 and not summary["failures"], (
        f"fuzz run failed (seed {summary['seed']}; rerun with --seed {summary['seed']}):\n"
        + "\n".join(summary["failures"]) + f"\n--- broker log tail ---\n{summary.get('server_log_tail', '')}")
    return summary


def _check(summary: dict, inputs: int) -> None:
    assert summary["inputs"] >= inputs
    assert not summary["crashed"] and summary["internal_errors"] == 0 and not summary["violations"]
    assert all(r["current_connections"] == 1 for r in summary["rounds"]), "connections leaked"
    assert summary["fds_after"] <= summary["fds_baseline"] + 2
    assert summary["rss_growth_mb"] <= 24
    # the fuzzer reached the broker: most inputs were answered, with a spread of replies
    assert summary["replies_total"] > inputs // 4
    assert {"INSERTED", "RESERVED", "DELETED", "BAD_FORMAT", "UNKNOWN_COMMAND"} <= set(summary["replies"])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_long_full(tmp_path):
    summary = _run(tmp_path, timeout=3500)
    _check(summary, 1_000_000)


@pytest.mark.timeout(120)
def test_fuzz_long_quick_smoke(tmp_path):
    summary = _run(tmp_path, "--quick", "--seed", "7", timeout=110)
    _check(summary, 20_000)
