"""`flashrt evaluate` on a local Ray cluster of 2 CPU workers with the tiny model (images 56x56, act 10 Hz, so a
0.4 s bag is five decisions): 8 bags made with `flashrt make-bag` (one corrupt, one without a camera topic the
contract needs) are each reported exactly once; with a worker killed mid-bag the bag is retried on the other
worker and nothing is reported twice; an evaluation interrupted after three bags and started again replays only
the other five and ends with the report of an uninterrupted run; each bag's numbers are those of
`flashrt replay` on that bag. Ray clusters are started and shut down inside each evaluate call."""
import contextlib
import json
import pathlib
import shutil

import numpy as np
import pytest
import yaml

pytest.importorskip("ray")

from flashrt_ros.cli import main  # noqa: E402
from flashrt_ros.evaluate import EvaluateError, evaluate  # noqa: E402
from flashrt_ros.evaluate.worker import strip_report  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SEEDS = range(6)  # the good bags, recorded with these noise seeds: seed 0 replays its recorded actions
WALL_CLOCK = ("p50", "p90", "p99", "max", "mean", "deadline_misses")  # what depends on the machine's speed


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    data = yaml.safe_load((REPO / "config" / "pi05_tiny.yaml").read_text())
    data["model"]["options"].update(image_height=56, image_width=56)
    data["stages"]["act"]["trigger"]["rate_hz"] = 10
    data["stages"]["observe"]["trigger"]["rate_hz"] = 5
    contract = root / "tiny_small.yaml"
    contract.write_text(yaml.safe_dump(data, sort_keys=False))
    bags = root / "bags"

    def make(name, *extra):
        assert main(["make-bag", str(bags / name), "--duration", "0.4", "--size", "30x40", "--config", str(contract),
                     "--no-progress", *extra]) == 0

    for s in SEEDS:
        make(f"seed{s}", "--seed", str(s), *(["--storage", "sqlite3"] if s == 4 else []))
    make("one_camera", "--cameras", "1")
    shutil.copytree(bags / "seed0", bags / "corrupt")
    mcap = next((bags / "corrupt").glob("*.mcap"))
    mcap.write_bytes(mcap.read_bytes()[:300] + b"\x00" * 64)  # the header survives, the rest is gone
    return {"bags": bags, "contract": contract}


def run(fleet, report, **kw):
    return evaluate([str(fleet["bags"])], report, config=fleet["contract"], workers=2, progress=False, **kw)


@pytest.fixture(scope="module")
def uninterrupted(fleet, tmp_path_factory):
    report = tmp_path_factory.mktemp("uninterrupted") / "report"
    return run(fleet, report), report


def bag_numbers(replay_data: dict) -> dict:
    """A bag's replay numbers that follow from the bag, contract and seed alone (not the machine's speed)."""
    d = json.loads(json.dumps(strip_report(replay_data), default=lambda o: o.tolist()))
    d.pop("wall_s")
    for row in list(d.get("stages", {}).values()) + [d.get("tick", {})]:
        for k in WALL_CLOCK:
            row.pop(k, None)
    (d.get("compare") or {}).pop("compare_tick_latency_ms", None)
    return d


def fleet_numbers(data: dict) -> dict:
    """A fleet report's rows and distributions without what depends on the machine or on worker deaths."""
    rows = [{k: v for k, v in r.items() if k not in ("latency_ms", "attempts", "worker_deaths")}
            for r in data["rows"]]
    dist = {k: v for k, v in data["distributions"].items() if not k.endswith("_ms") or "age" in k}
    totals = {k: v for k, v in data["totals"].items() if k not in ("retried", "worker_deaths")}
    return {"rows": rows, "distributions": dist, "totals": totals, "chunk_mse": data["pooled"]["chunk_mse"]}


def reported(report) -> list[str]:
    return sorted(p.stem for p in (report / "bags").glob("*.json"))


def test_eight_bags_each_reported_once_with_the_bad_ones_as_rows(uninterrupted):
    data, report = uninterrupted
    keys = [r["key"] for r in data["rows"]]
    assert len(keys) == 8 and len(set(keys)) == 8 and reported(report) == sorted(keys)
    manifest = json.loads((report / "manifest.json").read_text())
    assert sorted(manifest["runs"][0]["replayed"]) == sorted(keys) and not manifest["runs"][0]["interrupted"]
    assert data["totals"] == {"bags": 8, "with_result": 8, "ok": 6, "errors": 2, "without_result": 0,
                              "decisions": 30, "refused": 0, "retried": 0, "worker_deaths": 0}
    failed = {pathlib.Path(r["bag"]).name: r["error"] for r in data["rows"][:2]}  # (worst first: errors first)
    assert set(failed) == {"corrupt", "one_camera"}
    assert "corrupt or truncated" in failed["corrupt"]
    assert "missing topic(s) /camera1/image_raw; the bag has: /camera0/image_raw" in failed["one_camera"]
    mse = [r["action_error"]["mse"] for r in data["rows"][2:]]
    assert mse == sorted(mse, reverse=True) and mse[-1] < 1e-12 < mse[-2]  # seed0 replays its own recording
    assert pathlib.Path(data["rows"][-1]["bag"]).name == "seed0"
    md = (report / "report.md").read_text()
    assert "## Bags that could not be replayed" in md and "## Bags, worst first" in md
    assert data["plots"] == ["latency.png", "action_error.png", "worst_bag_actions.png"]
    for name in data["plots"]:
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def torch_threads(n):
    """Float sums depend on how many threads split them: the workers each run one (2 on 2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_each_bag_has_the_numbers_of_flashrt_replay(fleet, uninterrupted):
    from flashrt_ros.replay.errors import ReplayError
    from flashrt_ros.replay.replay import replay

    data, report = uninterrupted
    assert data["evaluation"]["workers"][0]["pid"] and data["evaluation"]["actors"] == 2
    for r in data["rows"]:
        row = json.loads((report / "bags" / f"{r['key']}.json").read_text())
        with torch_threads(1):
            try:
                alone = replay(row["bag"], config=fleet["contract"], seed=0, progress=False)
            except ReplayError as e:
                assert row["status"] == "error" and row["error"] == str(e)
                continue
        assert row["status"] == "ok" and bag_numbers(row["replay"]) == bag_numbers(alone.data)
        with np.load(report / "bags" / f"{r['key']}.npz") as z:
            np.testing.assert_array_equal(z["first_actions"], np.stack([t.actions[0] for t in alone.ticks]))


def test_a_worker_killed_mid_bag_has_its_bag_retried_once_elsewhere(fleet, uninterrupted, tmp_path):
    marker = tmp_path / "killed"
    hook = {"worker_process_setup_hook": "evaluate_faults.kill_mid_bag",
            "env_vars": {"PYTHONPATH": str(REPO / "test"), "FLASHRT_TEST_KILL_BAG": "seed3",
                         "FLASHRT_TEST_KILL_MARKER": str(marker)}}
    data = run(fleet, tmp_path / "report", runtime_env=hook)
    killed_pid = int(marker.read_text())
    row = next(r for r in data["rows"] if pathlib.Path(r["bag"]).name == "seed3")
    assert row["status"] == "ok" and row["attempts"] == 2 and row["worker_deaths"] == 1
    detail = json.loads((tmp_path / "report" / "bags" / f"{row['key']}.json").read_text())
    assert detail["worker"]["pid"] != killed_pid  # (Ray says the actor died, or is unavailable while it restarts)
    assert detail["worker_deaths"][0].split(":")[0] in ("ActorDiedError", "ActorUnavailableError")
    replayed = json.loads((tmp_path / "report" / "manifest.json").read_text())["runs"][0]["replayed"]
    assert len(replayed) == 8 and len(set(replayed)) == 8 and len(reported(tmp_path / "report")) == 8
    # a bag queued on the dead worker behind seed3 (Ray hands an actor its next call before the current one ends)
    # is retried too, under load: every retried bag is one that ran into that death, and each is reported once
    retried = [r for r in data["rows"] if r.get("attempts", 1) > 1]
    assert data["totals"]["retried"] == len(retried) >= 1 and all(r["status"] == "ok" for r in retried)
    assert fleet_numbers(data) == fleet_numbers(uninterrupted[0])


def test_an_interrupted_evaluation_continues_where_it_stopped(fleet, uninterrupted, tmp_path):
    report, seen = tmp_path / "report", []

    def interrupt_after_three(row):
        seen.append(row["key"])
        if len(seen) == 3:
            raise KeyboardInterrupt

    first = run(fleet, report, on_result=interrupt_after_three)
    assert first["interrupted"] and first["totals"]["with_result"] == 3 and reported(report) == sorted(seen)
    assert "5 not replayed yet" in (report / "report.md").read_text()
    with pytest.raises(EvaluateError, match="another evaluation .*seed: 0 there, 1 here"):
        run(fleet, report, seed=1)
    second = run(fleet, report)
    runs = json.loads((report / "manifest.json").read_text())["runs"]
    assert len(runs) == 2  # (the refused one left no trace)
    assert runs[1]["reused"] == 3 and len(runs[1]["replayed"]) == 5 and not set(runs[1]["replayed"]) & set(seen)
    assert not second["interrupted"] and fleet_numbers(second) == fleet_numbers(uninterrupted[0])


def test_a_lerobot_dataset_is_evaluated_episode_by_episode(fleet, tmp_path):
    """A LeRobot v3 dataset folder among BAGS: each episode is a unit, converted by the worker that replays it
    (lerobot_dataset.write_bag), with the dataset's actions as the reference; its numbers are those of
    `flashrt replay` on the bag `flashrt make-bag --from-lerobot` writes for that episode."""
    pytest.importorskip("av")
    from lerobot_v3_writer import FPS, LENGTHS, write_dataset

    from flashrt_ros.replay.replay import replay

    dataset = write_dataset(tmp_path / "dataset")
    data = yaml.safe_load(fleet["contract"].read_text())
    for stage in ("act", "observe"):  # a decision at every frame
        data["stages"][stage]["trigger"]["rate_hz"] = FPS
    contract = tmp_path / "at_fps.yaml"
    contract.write_text(yaml.safe_dump(data, sort_keys=False))
    out = evaluate([str(dataset)], tmp_path / "report", config=contract, workers=2, progress=False)
    rows = sorted(out["rows"], key=lambda r: r["episode"])
    assert [(r["episode"], r["status"], r["action_error"]["matched"]) for r in rows] == [
        (i, "ok", n) for i, n in enumerate(LENGTHS)]
    assert all(r["action_error"]["mse"] > 0.01 for r in rows)  # (a random tiny model is no teleoperator)
    bags = tmp_path / "bags"
    assert main(["make-bag", "--from-lerobot", str(dataset), str(bags), "--episodes", "1"]) == 0
    with torch_threads(1):
        alone = replay(bags / "episode_000001", config=contract, topics=str(bags / "topics.yaml"), progress=False)
    row = json.loads((tmp_path / "report" / "bags" / f"{rows[1]['key']}.json").read_text())
    theirs, ours = bag_numbers(alone.data), bag_numbers(row["replay"])
    assert theirs.pop("bag")["topics"] == ours.pop("bag")["topics"]  # (converted in another folder)
    assert ours == theirs


def test_compare_gives_the_per_bag_difference_of_two_configurations(fleet, tmp_path, capsys):
    """From the command line, two bags through the contract and a second one observing at 10 Hz (other prefixes,
    the same noise): per bag, their agreement and the difference of their errors, as `flashrt replay --compare`."""
    from flashrt_ros.replay.replay import replay

    data = yaml.safe_load(fleet["contract"].read_text())
    data["stages"]["observe"]["trigger"]["rate_hz"] = 10
    other = tmp_path / "observe_10hz.yaml"
    other.write_text(yaml.safe_dump(data, sort_keys=False))
    bags = [str(fleet["bags"] / "seed0"), str(fleet["bags"] / "seed1")]
    report = tmp_path / "report"
    assert main(["evaluate", *bags, "--contract", str(fleet["contract"]), "--compare", str(other), "--workers", "2",
                 "--report", str(report), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "evaluated 2 of 2 bags: 2 ok, 0 failed, 10 decisions" in printed and "compare.png" in printed
    md = (report / "report.md").read_text()
    assert "## The two configurations per bag" in md and "![compare.png](compare.png)" in md
    out = json.loads((report / "report.json").read_text())
    for r in out["rows"]:
        with torch_threads(1):
            alone = replay(r["bag"], config=fleet["contract"], compare=other, progress=False)
        row = json.loads((report / "bags" / f"{r['key']}.json").read_text())
        ours = bag_numbers(row["replay"])
        assert ours["compare"].pop("action_error")["mse"] == pytest.approx(
            r["action_error"]["mse"] + r["compare"]["action_mse_diff"])
        assert ours == bag_numbers(alone.data) and r["compare"]["rmse"] > 0
