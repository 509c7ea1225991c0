"""`flashrt make-bag` and `flashrt replay` through the console script's parser: exit codes, the summary
table, the report folder, and a clear message (exit 1) for a bad bag."""
import pathlib

import pytest
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
    assert "replay [" not in captured.err and "%" not in captured.err  # no progress bar: stderr is no terminal
    assert (report / "report.md").is_file() and (report / "actions.png").is_file()
    # the same bag read with a mapping that names a topic it lacks
    assert main(["replay", bag, "--config", cfg, "--joints", "/arm/joint_states", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "missing topic(s) /arm/joint_states; the bag has: /camera0/image_raw" in err
    # an existing output path is never overwritten
    assert main(["make-bag", bag, "--duration", "0.5", "--no-progress"]) == 1
    assert "exists already" in capsys.readouterr().err


def test_make_bag_that_fails_leaves_nothing_behind(tmp_path):
    """A bag is written beside its destination and moved there when complete: a failure part-way (here more
    joints than the tiny contract's state holds) leaves no half bag that would block the next try."""
    from flashrt_ros.replay.errors import ReplayError
    from flashrt_ros.replay.make_bag import make_bag

    out = tmp_path / "bag"
    with pytest.raises(Exception):
        make_bag(out, duration=0.3, joints=20, height=48, width=64)
    assert list(tmp_path.iterdir()) == []
    for bad in (dict(duration=float("nan")), dict(duration=float("inf")), dict(height=0)):
        with pytest.raises(ReplayError, match="must be (a )?positive"):
            make_bag(out, **{"duration": 0.3, **bad})
    summary = make_bag(out, duration=0.3, height=48, width=64)
    assert summary["path"] == str(out) and (out / "metadata.yaml").is_file() and (out / "bag.mcap").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["bag"]


class _Terminal:
    """A stderr stand-in that says it is a terminal, and keeps what was written."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, []

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text.append(text)

    def flush(self):
        pass


def test_the_progress_bar_is_drawn_on_a_terminal_only():
    import random

    from flashrt_ros.replay.progress import Progress

    rng = random.Random(9)
    start = rng.randint(1, 10**6) * 10**9
    span_s = rng.randint(2, 9)
    for tty in (True, False):
        out = _Terminal(tty)
        bar = Progress(start, start + span_s * 10**9, stream=out, label="make-bag")
        bar.update(start + span_s * 10**9 // 2, 7, force=True)
        bar.close(start + span_s * 10**9, 13)
        text = "".join(out.text)
        if not tty:
            assert text == ""
            continue
        assert f"make-bag [###############               ]  50.0%  bag {span_s / 2:.2f}/{span_s:.2f} s, 7 decisions" \
            in text, text
        assert f"100.0%  bag {span_s:.2f}/{span_s:.2f} s, 13 decisions" in text and text.endswith("\n")
    quiet = _Terminal(True)
    bar = Progress(start, start + 10**9, enabled=False, stream=quiet)
    bar.update(start + 10**8, 1, force=True)
    bar.close(start + 10**9, 2)
    assert quiet.text == []  # --no-progress


def test_replay_takes_the_contract_a_node_takes_for_a_checkpoint(tmp_path):
    """Without --config the replay's contract is the node's: the tiny model's, or for --checkpoint its model's
    packaged contract, configured with that checkpoint (a pi0 one included, whose contract needs it)."""
    from lerobot_checkpoint import PI0_FIXTURE, checkpoint_copy

    from flashrt_core.contract.spec import configured_contract
    from flashrt_ros.replay.runtimes import default_config

    assert default_config().name == "pi05_tiny.yaml"
    ckpt = checkpoint_copy(tmp_path, PI0_FIXTURE)
    assert default_config(str(ckpt)).name == "pi0.yaml"
    contract = configured_contract(default_config(str(ckpt)), checkpoint=str(ckpt))
    assert contract.model.name == "pi0" and contract.model.checkpoint == str(ckpt)


def test_a_pi0_checkpoint_records_a_bag_and_replays_it_with_its_tokenizer(tmp_path):
    """make-bag and replay take a LeRobot checkpoint and its tokenizer, as the node does: the pi0 contract is
    picked from the checkpoint, and the replay on the bag clock remakes every recorded chunk exactly."""
    from lerobot_checkpoint import PI0_FIXTURE, checkpoint_copy

    from flashrt_ros.replay.make_bag import make_bag
    from flashrt_ros.replay.replay import replay

    ckpt = checkpoint_copy(tmp_path, PI0_FIXTURE)
    tokenizer = str(PI0_FIXTURE / "hf_tokenizer")
    summary = make_bag(tmp_path / "bag", duration=0.3, height=48, width=64, checkpoint=str(ckpt), tokenizer=tokenizer)
    assert summary["config"].endswith("pi0.yaml") and summary["decisions"] > 5, summary
    report = replay(tmp_path / "bag", checkpoint=str(ckpt), tokenizer=tokenizer, progress=False)
    err = report.data["action_error"]
    assert report.data["status"] == "ok" and err["matched"] == summary["decisions"] and err["max_abs"] == 0.0, err


def test_replay_takes_the_model_from_a_node_params_file_given_as_topics(tmp_path, capsys):
    """`--topics robot.yaml` (the node's own params file): its checkpoint and tokenizer apply too, and it says
    so; a flag given on the command line wins over the file."""
    from lerobot_checkpoint import PI0_FIXTURE, checkpoint_copy

    from flashrt_ros.cli import main
    from flashrt_ros.replay.make_bag import make_bag

    ckpt = checkpoint_copy(tmp_path, PI0_FIXTURE)
    tokenizer = str(PI0_FIXTURE / "hf_tokenizer")
    summary = make_bag(tmp_path / "bag", duration=0.3, height=48, width=64, checkpoint=str(ckpt), tokenizer=tokenizer)
    params = tmp_path / "robot.yaml"
    params.write_text(f"policy_node:\n  ros__parameters:\n    checkpoint: {ckpt}\n    tokenizer: {tokenizer}\n"
                      "    camera_topics: [/camera0/image_raw, /camera1/image_raw]\n    seed: 0\n")
    assert main(["replay", str(tmp_path / "bag"), "--topics", str(params), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert f"from {params}: checkpoint {ckpt}, tokenizer {tokenizer}, seed 0" in err, err
    n = summary["decisions"]
    assert f"action error vs recorded: {n}/{n} chunks matched, MSE 0.000e+00" in out, out
    # --seed on the command line wins: other noise, other actions than the recorded ones
    assert main(["replay", str(tmp_path / "bag"), "--topics", str(params), "--seed", "1", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "seed 0" not in err and f"{n}/{n} chunks matched, MSE 0.000e+00" not in out, out
