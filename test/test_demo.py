"""`flashrt demo` end to end: separate processes, chunks at the configured rate, capsule services."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]


def test_demo_reports_chunks_at_the_configured_rate(tmp_path):
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "flashrt_ros.cli", "demo", "--duration", "6",
                           "--json", str(summary_path)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert abs(summary["rate_hz"] - summary["target_act_hz"]) <= 0.2 * summary["target_act_hz"]
    assert summary["capsules_ok"] and summary["all_finite"] and summary["shape"] == "50x7"
    assert 0 < summary["prefix_refresh_hz"] < summary["rate_hz"]
    assert "chunks received" in proc.stdout and "demo ok" in proc.stdout


def test_demo_refuses_a_contract_that_cannot_load_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nmodel: {name: pi05}\nstages: {}\n")
    proc = subprocess.run([sys.executable, "-m", "flashrt_ros.cli", "demo", "--duration", "6", "--config", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"--config {bad}: INVALID: " in proc.stderr, proc.stdout + proc.stderr
    assert "chunks received" not in proc.stdout and "flashrt demo: ROS_DOMAIN_ID" not in proc.stdout
