"""make-bag -> replay in both storages: the recorded actions are reproduced exactly on the bag clock, the
report's counts, stage runs and observation ages follow from the known rates, and a second contract (the
fused engine) fed the same inputs and noise agrees with the reference within the parity tolerance."""
import json
import pathlib

import numpy as np
import pytest
import yaml

from flashrt_ros.replay.make_bag import make_bag
from flashrt_ros.replay.replay import replay

# tolerance table (absolute, actions in normalized space)
TOL = {
    "same_contract_and_seed": 0.0,  # same ops, same inputs, same noise on the same device: bit-identical
    "fused_vs_reference_max_abs": 1e-4,  # fp32 CPU, measured ~5e-7
    "fused_vs_reference_cosine_min": 0.99999,
    "age_ms": 1e-6,
}

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
ACT_HZ, OBSERVE_HZ = 10, 5  # lower than the packaged 50/10 Hz so the CPU test stays fast
DURATION, H, W, SEED = 1.5, 48, 64, 3
TICKS = int(DURATION * ACT_HZ) + 1  # grid points 0, 0.1, ..., 1.5 s


def contract_copy(path, **model):
    data = yaml.safe_load(CONFIG.read_text())
    data["stages"]["act"]["trigger"]["rate_hz"] = ACT_HZ
    data["stages"]["observe"]["trigger"]["rate_hz"] = OBSERVE_HZ
    options = model.pop("options", {})
    data["model"].update(model)
    data["model"]["options"].update(options)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def contracts(tmp_path_factory):
    d = tmp_path_factory.mktemp("contracts")
    return {"reference": contract_copy(d / "tiny.yaml"),
            "fused": contract_copy(d / "tiny_fused.yaml", options={"engine": "fused"})}


@pytest.fixture(scope="module")
def bags(tmp_path_factory, contracts):
    d = tmp_path_factory.mktemp("bags")
    return {s: (d / s, make_bag(d / s, storage=s, duration=DURATION, height=H, width=W, seed=SEED,
                                config=contracts["reference"]))
            for s in ("mcap", "sqlite3")}


def expected_ages_ms():
    """observe runs every other act tick on a fresh camera frame stamped exactly then (30 Hz divides 5 Hz):
    the chunk's observation is 0 ms old at an observe tick and one act period old at the next."""
    return [0.0 if k % (ACT_HZ // OBSERVE_HZ) == 0 else 1000.0 / ACT_HZ for k in range(TICKS)]


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_make_bag_writes_the_storage_and_topics(bags, storage):
    path, summary = bags[storage]
    suffix = {"mcap": ".mcap", "sqlite3": ".db3"}[storage]
    assert [p.suffix for p in path.iterdir() if p.suffix != ".yaml"] == [suffix]
    frames = int(DURATION * 30) + 1
    assert summary["topics"] == {"/camera0/image_raw": frames, "/camera1/image_raw": frames,
                                 "/joint_states": int(DURATION * 200) + 1, "/policy_node/prompt": 1,
                                 "/policy_node/action_chunk": TICKS}
    assert summary["decisions"] == TICKS


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_replay_reproduces_recorded_actions_and_counts(bags, contracts, storage, tmp_path):
    path, _ = bags[storage]
    report = replay(path, config=contracts["reference"], seed=SEED, report_dir=tmp_path, progress=False)
    d = report.data
    assert report.ok and d["error"] is None and d["bag"]["storage"] == storage
    assert d["ticks"] == TICKS and d["decisions"] == TICKS
    err = d["action_error"]
    assert err["recorded"] == err["matched"] == TICKS and err["unmatched_recorded"] == 0
    assert err["rows"] == 50 and err["columns"] == 7
    assert err["mse"] <= TOL["same_contract_and_seed"] and err["max_abs"] <= TOL["same_contract_and_seed"]
    stages = d["stages"]
    assert stages["prompt"]["n"] == 1 and stages["act"]["n"] == TICKS
    assert stages["observe"]["n"] == (TICKS + 1) // 2
    assert stages["act"]["period_ms"] == pytest.approx(100.0) and stages["observe"]["period_ms"] == pytest.approx(200.0)
    assert stages["prompt"]["deadline_misses"] is None
    ages = [row["observation_age_ms"] for row in d["decisions_table"]]
    np.testing.assert_allclose(ages, expected_ages_ms(), atol=TOL["age_ms"], rtol=0)
    assert d["staleness"]["max"] == pytest.approx(100.0) and d["staleness"]["refused"] == 0
    # letterboxing 64x48 -> 224x224 is reported, not silent
    assert any("letterboxed" in n for n in d["input_notes"])
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["action_error"]["max_abs"] == err["max_abs"] and on_disk["status"] == "ok"
    for name in ("report.md", "latency.png", "observation_age.png", "actions.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| act | 16 |" in (tmp_path / "report.md").read_text()


def test_another_seed_does_not_reproduce_the_recorded_actions(bags, contracts):
    """The zero error above is not vacuous: other weights and noise (seed) give a large error."""
    report = replay(bags["mcap"][0], config=contracts["reference"], seed=SEED + 1, progress=False)
    assert report["action_error"]["matched"] == TICKS
    assert report["action_error"]["max_abs"] > 0.1


def test_compare_fused_engine_agrees_with_reference_on_same_inputs_and_noise(bags, contracts):
    report = replay(bags["mcap"][0], config=contracts["reference"], compare=contracts["fused"], seed=SEED,
                    progress=False)
    c = report["compare"]
    assert c["decisions"] == TICKS and c["mismatched_decisions"] == 0
    assert c["max_abs"] <= TOL["fused_vs_reference_max_abs"]
    assert c["cosine_min"] >= TOL["fused_vs_reference_cosine_min"]
    assert report["action_error"]["max_abs"] == 0.0  # the main contract is unaffected by the comparison
    assert "compare" in report.summary_table()


def test_replay_measures_the_splices_with_rtc_on_and_off(bags, contracts, tmp_path):
    """--compare a contract with model.options.rtc: the report has the splice metrics of both (new vs old chunk
    over their overlap, jerk of the executed stream at the splices) and their plot; RTC pulls each chunk
    towards the rest of the previous one, so the overlap disagrees less than without it (measured on this
    tiny random model: RMS p50 2.05 -> 1.60 at 10 Hz act, 10 Hz actions)."""
    on = contract_copy(tmp_path / "rtc.yaml", options={"rtc": {"execution_horizon": 20, "action_rate_hz": 10}})
    report = replay(bags["mcap"][0], config=contracts["reference"], compare=on, seed=SEED, progress=False,
                    action_dt_s=0.1, report_dir=tmp_path / "report")
    plain, rtc_on = report.data["splice"]["replayed"], report.data["splice"]["compare"]
    assert plain["splices"] == rtc_on["splices"] == TICKS - 1
    assert rtc_on["disagreement"]["p50"] < 0.9 * plain["disagreement"]["p50"]
    assert plain["splice_jerk"]["n"] > 0 and rtc_on["splice_jerk"]["n"] > 0
    assert "splices.png" in report.data["plots"] and (tmp_path / "report" / "splices.png").is_file()
    assert any(line.startswith("splices (compare") for line in report.summary_table().splitlines())
