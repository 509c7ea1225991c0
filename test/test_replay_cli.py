"""`flashrt make-bag` and `flashrt replay` through the console script's parser: exit codes, the summary
table, the report folder, and a clear message (exit 1) for a bad bag."""
import pathlib

import yaml

from flashrt_ros.cli import main

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"


def slow_contract(path):
    data = yaml.safe_load(CONFIG.read_text())
    data["stages"]["act"]["trigger"]["rate_hz"] = 10
    data["stages"]["observe"]["trigger"]["rate_hz"] = 5
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_make_bag_then_replay_from_the_command_line(tmp_path, capsys):
    cfg = slow_contract(tmp_path / "tiny.yaml")
    bag = str(tmp_path / "bag")
    assert main(["make-bag", bag, "--storage", "sqlite3", "--duration", "0.5", "--size", "30x40", "--config", cfg,
                 "--seed", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "6 recorded decisions" in out and "/joint_states: 101 messages" in out
    report = tmp_path / "report"
    assert main(["replay", bag, "--config", cfg, "--seed", "2", "--report", str(report)]) == 0
    captured = capsys.readouterr()
    assert "stage" in captured.out and "p99 ms" in captured.out and "tick (all stages)" in captured.out
    assert "action error vs recorded: 6/6 chunks matched, MSE 0.000e+00, max |err| 0.000e+00" in captured.out
    assert "replay [" in captured.err and "100.0%" in captured.err  # the progress bar
    assert (report / "report.md").is_file() and (report / "actions.png").is_file()
    # the same bag read with a mapping that names a topic it lacks
    assert main(["replay", bag, "--config", cfg, "--joints", "/arm/joint_states", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "missing topic(s) /arm/joint_states; the bag has: /camera0/image_raw" in err
    # an existing output path is never overwritten
    assert main(["make-bag", bag, "--duration", "0.5", "--no-progress"]) == 1
    assert "exists already" in capsys.readouterr().err
