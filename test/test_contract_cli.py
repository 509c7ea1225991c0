"""`flashrt contract check|simulate` through the functions and the argparse wiring the console script uses."""
import argparse
import json
import pathlib

from flashrt_core.contract import cli

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"


def parse(argv):
    parser = argparse.ArgumentParser(prog="flashrt")
    cli.add_subparsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_check_ok(capsys):
    assert cli.contract_check(CONFIG) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "stage act: 50 Hz" in out and "buffer actions: [50, 7] float32 transient" in out


def test_check_invalid_prints_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("trigger: {rate_hz: 50}", "trigger: {rate_hz: -50}"))
    args = parse(["contract", "check", str(bad)])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "INVALID" in err and "stages.act.trigger.rate_hz: must be a positive number, got -50" in err


def test_check_with_a_checkpoint_validates_a_contract_that_needs_one(tmp_path, capsys):
    """config/pi0.yaml names no checkpoint: alone it is refused for that reason, with --checkpoint it is checked
    against the checkpoint's shapes (a pi0.5 checkpoint is refused for it)."""
    from lerobot_checkpoint import FIXTURE, PI0_FIXTURE, checkpoint_copy

    pi0 = CONFIG.parent / "pi0.yaml"
    assert cli.contract_check(pi0) == 1
    assert "model.checkpoint: model pi0 needs a checkpoint" in capsys.readouterr().err
    args = parse(["contract", "check", str(pi0), "--checkpoint", str(checkpoint_copy(tmp_path / "a", PI0_FIXTURE))])
    assert args.func(args) == 0
    assert "OK" in capsys.readouterr().out
    args = parse(["contract", "check", str(pi0), "--checkpoint", str(checkpoint_copy(tmp_path / "b", FIXTURE))])
    assert args.func(args) == 1
    assert "is a pi05 checkpoint" in capsys.readouterr().err


def test_simulate_json_and_table(capsys):
    args = parse(["contract", "simulate", str(CONFIG), "--duration", "0.5", "--json"])
    assert args.func(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["stages"]["act"]["runs"] == 25 and rep["stages"]["observe"]["runs"] == 5
    assert [e["stage"] for e in rep["events"][:4]] == ["prompt", "observe", "act", "act"]
    assert cli.contract_simulate(CONFIG, 0.2, as_json=False, tick_hz=25) == 0
    out = capsys.readouterr().out
    assert "simulated 0.2 s: 5 ticks" in out and "misses" in out
    assert cli.contract_simulate(CONFIG, -1.0) == 1
    assert "duration_s must be positive" in capsys.readouterr().err


def test_simulate_refuses_rates_that_are_not_positive(capsys):
    """A negative tick rate used to loop for ever, and 0 to be taken as 'not set'."""
    for flag, value in (("--tick-hz", "-5"), ("--tick-hz", "0"), ("--observation-hz", "0"), ("--tick-hz", "nan")):
        args = parse(["contract", "simulate", str(CONFIG), "--duration", "0.5", flag, value])
        assert args.func(args) == 1
        err = capsys.readouterr().err
        assert "must be a rate in (0, 10000] Hz" in err, (flag, value, err)
    args = parse(["contract", "simulate", str(CONFIG), "--duration", "inf"])
    assert args.func(args) == 1 and "duration_s must be positive and finite" in capsys.readouterr().err
