"""The replay's arithmetic on hand-made inputs (no model): percentiles and deadline misses, matching
decisions to recorded chunks, action error, two-contract agreement, the bag-clock grid, topic mapping,
letterboxing."""
import pathlib

import numpy as np
import pytest

from flashrt_ros.replay import metrics
from flashrt_ros.replay.clock import tick_times
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.fit import letterbox
from flashrt_ros.replay.player import RecordedChunk, TickRecord
from flashrt_ros.replay.topics import load_topic_map

TOL = {"float": 1e-12}
MS = 1_000_000


def tick(t_ms, latency, stages=None, actions=None, age=None, reason=None, compare=None):
    return TickRecord(t_ns=int(t_ms * MS), ran=list(stages or {}), latency_ms=latency, stage_latency_ms=stages or {},
                      decision_id=None, actions=actions, observation_age_ms=age, observation_stamp_ns=None,
                      reason=reason, compare_actions=[] if compare is None else [compare],
                      compare_latency_ms=[] if compare is None else [1.0])


def chunk(t_ms, actions):
    return RecordedChunk(t_ns=int(t_ms * MS), stamp_ns=int(t_ms * MS), decision_id=0, actions=actions,
                         latency_ms=0.0, observation_age_ms=0.0, stages_ran=["act"])


def test_stage_percentiles_and_deadline_misses():
    rng = np.random.default_rng(7)
    act = rng.uniform(5, 30, 37)
    obs = rng.uniform(50, 130, 10)
    ticks = [tick(20 * i, a + (obs[i // 4] if i % 4 == 0 else 0.0),
                  {"act": a, **({"observe": obs[i // 4]} if i % 4 == 0 else {})}) for i, a in enumerate(act)]
    rows = metrics.stage_latency(ticks, {"act": 20.0, "observe": 100.0, "prompt": None})
    p50, p90, p99 = np.percentile(act, [50, 90, 99])
    assert rows["act"]["n"] == 37 and rows["act"]["p50"] == pytest.approx(p50, abs=TOL["float"])
    assert rows["act"]["p90"] == pytest.approx(p90) and rows["act"]["p99"] == pytest.approx(p99)
    assert rows["act"]["deadline_misses"] == int((act > 20).sum()) > 0
    assert rows["observe"]["n"] == 10 and rows["observe"]["deadline_misses"] == int((obs > 100).sum())
    total = metrics.tick_latency(ticks, 20.0)
    assert total["deadline_misses"] == sum(t.latency_ms > 20 for t in ticks)
    # a graph group key (contract graphs: plan) takes the tightest period of its members
    grouped = metrics.stage_latency([tick(0, 30.0, {"observe+act": 30.0})], {"act": 20.0, "observe": 100.0})
    assert grouped["observe+act"]["period_ms"] == 20.0 and grouped["observe+act"]["deadline_misses"] == 1


def test_action_error_matches_by_decision_time_and_counts_leftovers():
    rng = np.random.default_rng(3)
    pred = [rng.standard_normal((5, 9)).astype(np.float32) for _ in range(6)]
    delta = [rng.standard_normal((5, 4)).astype(np.float32) * 0.1 for _ in range(6)]
    ticks = [tick(20 * i, 1.0, actions=p) for i, p in enumerate(pred)]
    # recorded: 4 columns (the node publishes len(joint_names)), stamps jittered by < half a period,
    # decision 5 missing, and one extra chunk far from every tick
    recorded = [chunk(20 * i + (-3 if i % 2 else 4), pred[i][:, :4] + delta[i]) for i in range(5)]
    recorded.append(chunk(500, pred[0][:, :4]))
    e = metrics.action_error(ticks, recorded, tolerance_ns=10 * MS)
    assert e["matched"] == 5 and e["unmatched_decisions"] == 1 and e["unmatched_recorded"] == 1
    assert e["columns"] == 4 and e["rows"] == 5
    d = np.stack([dl.astype(np.float64) for dl in delta[:5]])
    assert e["mse"] == pytest.approx(float(np.mean(d ** 2)), rel=1e-6)
    assert e["max_abs"] == pytest.approx(float(np.abs(d).max()), rel=1e-6)
    assert e["per_joint_mse"] == pytest.approx(list(np.mean(d ** 2, axis=(0, 1))), rel=1e-6)
    assert metrics.action_error(ticks, [], 10 * MS)["note"] == "the bag has no recorded actions"


def test_agreement_reports_max_diff_cosine_and_mismatched_decisions():
    rng = np.random.default_rng(5)
    a = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3)]
    b = [a[0], -a[1], a[2] + 0.01]
    ticks = [tick(20 * i, 1.0, actions=x, compare=y) for i, (x, y) in enumerate(zip(a, b))]
    ticks.append(tick(60, 1.0, actions=a[0], compare=None))
    ticks[-1].compare_actions = [None]  # the compare contract refused this decision
    c = metrics.agreement(ticks)
    assert c["decisions"] == 3 and c["mismatched_decisions"] == 1
    assert c["cosine_min"] == pytest.approx(-1.0) and c["max_abs"] == pytest.approx(float(np.abs(2 * a[1]).max()))


def test_staleness_counts_refusals_but_not_idle_ticks():
    ticks = [tick(0, 1.0, actions=np.ones((2, 2)), age=10.0), tick(20, 1.0, actions=np.ones((2, 2)), age=300.0),
             tick(40, 1.0, reason="act: observation is 320.0 ms old (limit 250 ms)"),
             tick(50, 0.1, reason="act is not due at this tick")]
    s = metrics.staleness(ticks, 250.0)
    assert s["n"] == 2 and s["max"] == 300.0 and s["over_limit"] == 1 and s["refused"] == 1


def test_bag_clock_merges_rate_grids_exactly():
    t0 = 1_000
    ticks = list(zip(range(11), tick_times(t0, {"act": 50, "observe": 10})))
    assert [t for _, t in ticks] == [t0 + 20 * MS * k for k in range(11)]
    odd = []
    for t in tick_times(0, {"a": 30, "b": 7}):
        if t > 1_000_000_000:
            break
        odd.append(t)
    expected = sorted({-(-n * 10**9 // 30) for n in range(31)} | {-(-n * 10**9 // 7) for n in range(8)})
    assert odd == expected  # 30 + 7 grid points, 0 shared except t0, no drift at 1 s


def test_topic_map_from_node_params_file_and_overrides(tmp_path):
    params = tmp_path / "node.yaml"
    params.write_text("policy_node:\n  ros__parameters:\n    camera_topics: [wrist/image_raw, top/compressed]\n"
                      "    joint_state_topic: arm/joint_states\n    joint_names: [a, b, '']\n")
    m = load_topic_map(params)
    assert m.cameras == ("/wrist/image_raw", "/top/compressed") and m.joint_states == "/arm/joint_states"
    assert m.joint_names == ("a", "b") and m.prompt == "/policy_node/prompt"
    m = load_topic_map(params, cameras="/c0,/c1,/c2", joint_names="x,y")
    assert m.cameras == ("/c0", "/c1", "/c2") and m.joint_names == ("x", "y")
    shipped = load_topic_map(pathlib.Path(__file__).resolve().parents[1] / "config" / "policy_node.yaml")
    assert shipped.prompt == "/policy_node/prompt" and shipped.actions == "/policy_node/action_chunk"  # key /**
    bad = tmp_path / "bad.yaml"
    bad.write_text("cameras: [/a]\ncamera_rate: 30\n")
    with pytest.raises(ReplayError, match="camera_rate: unknown key"):
        load_topic_map(bad)


def test_letterbox_keeps_aspect_and_centres():
    rng = np.random.default_rng(1)
    img = rng.integers(1, 256, (30, 60, 3), dtype=np.uint8)
    out = letterbox(img, 40, 40)
    assert out.shape == (40, 40, 3)
    rows = np.flatnonzero(out.any(axis=(1, 2)))
    assert rows[0] == 10 and rows[-1] == 29  # 60x30 -> 40x20, centred vertically
    assert letterbox(img, 30, 60) is img


def test_rosbags_messages_convert_like_rclpy_ones():
    """flashrt_ros.conversions reads rosbags dataclasses (numpy data fields) after a CDR round trip: padded
    rows, CompressedImage (png), JointState reordered by name."""
    import cv2

    from flashrt_ros import conversions
    from flashrt_ros.replay import bagio

    store = bagio.typestore()
    rng = np.random.default_rng(11)
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    header = store.types["std_msgs/msg/Header"](stamp=store.types["builtin_interfaces/msg/Time"](sec=1, nanosec=2),
                                                frame_id="cam")
    padded = np.concatenate([rgb.reshape(5, 21), np.full((5, 3), 99, np.uint8)], axis=1)
    img = store.types[bagio.IMAGE](header=header, height=5, width=7, encoding="rgb8", is_bigendian=0, step=24,
                                   data=padded.reshape(-1))
    img = store.deserialize_cdr(store.serialize_cdr(img, bagio.IMAGE), bagio.IMAGE)
    np.testing.assert_array_equal(conversions.image_to_rgb(img), rgb)
    png = np.frombuffer(cv2.imencode(".png", rgb[..., ::-1])[1].tobytes(), np.uint8)
    comp = store.types[bagio.COMPRESSED](header=header, format="png", data=png)
    comp = store.deserialize_cdr(store.serialize_cdr(comp, bagio.COMPRESSED), bagio.COMPRESSED)
    np.testing.assert_array_equal(conversions.compressed_to_rgb(comp), rgb)
    pos = rng.standard_normal(3)
    js = store.types[bagio.JOINT_STATE](header=header, name=["a", "b", "c"], position=pos,
                                        velocity=np.zeros(0), effort=np.zeros(0))
    js = store.deserialize_cdr(store.serialize_cdr(js, bagio.JOINT_STATE), bagio.JOINT_STATE)
    np.testing.assert_array_equal(conversions.joint_positions(js, ["c", "a"]), pos[[2, 0]].astype(np.float32))


@pytest.mark.parametrize("edit, message", [
    (lambda m: setattr(m, "observation_age_ms", float("nan")), r"message #4: observation_age_ms is nan"),
    (lambda m: (setattr(m, "horizon", 0), setattr(m, "actions", [])), r"message #4: an empty chunk \(0 x 2\)"),
])
def test_a_recorded_chunk_that_cannot_be_placed_is_a_replay_error(edit, message):
    from types import SimpleNamespace

    from flashrt_ros.replay.bagio import BagEvent

    msg = SimpleNamespace(actions=[0.5] * 6, horizon=3, action_dim=2, observation_age_ms=12.0, decision_id=1,
                          observation_stamp=SimpleNamespace(sec=5, nanosec=0), latency_ms=3.0, stages_ran=["act"],
                          joint_names=["a", "b"])
    assert RecordedChunk.from_msg(BagEvent("actions", 0, "/chunks", 0, 7, 4, msg)).t_ns == 5_012_000_000
    edit(msg)
    with pytest.raises(ReplayError, match=message):
        RecordedChunk.from_msg(BagEvent("actions", 0, "/chunks", 0, 7, 4, msg))


def test_shared_letterbox_is_pi05_resize_with_pad():
    """The node's and the replay's frame fitting is LeRobot's resize-with-pad, rounded to uint8."""
    import torch

    from flashrt_core.lerobot.preprocess import letterbox as shared, resize_with_pad

    img = np.random.default_rng(2).integers(1, 256, (48, 64, 3), dtype=np.uint8)
    assert letterbox is shared
    want = resize_with_pad(torch.from_numpy(img).permute(2, 0, 1)[None].float() / 255, 224, 224)[0]
    got = torch.from_numpy(shared(img, 224, 224)).permute(2, 0, 1).float() / 255
    assert (got - want).abs().max() <= 0.5 / 255 + 1e-6 and got[:, :28].abs().max() == 0  # 28 rows of padding on top


def test_a_short_state_is_refused_not_padded():
    from flashrt_ros.replay.errors import ReplayError
    from flashrt_ros.replay.fit import InputFitter

    class C:
        buffers = {"images": type("B", (), {"shape": (2, 224, 224, 3)}), "state": type("B", (), {"shape": (8,)})}
        model = type("M", (), {"name": "pi05"})  # (the frames' padding follows the model: contract.bindings.image_pad)
    fit = InputFitter(C())
    assert fit.state(np.ones(8, np.float32), "/j").shape == (8,)
    with pytest.raises(ReplayError, match="never padded"):
        fit.state(np.ones(7, np.float32), "/j")


def test_splice_metrics_measure_disagreement_and_jerk_where_chunks_join():
    """Decisions every 2 actions (dt 20 ms, a decision per 40 ms), chunks of 10 rows: a plan that stays the
    same (each chunk the previous one two actions on) has no disagreement and a straight executed stream (no
    jerk); a plan that jumps by 0.5 every other decision disagrees by 0.5 over the whole overlap, and its
    executed stream jerks at the splices (by 1 / dt^3 in the windows around them)."""
    ramp = np.arange(10, dtype=np.float32)[:, None]
    steady = [tick(40 * i, 1.0, {"act": 1.0}, actions=2 * i + ramp) for i in range(6)]
    out = metrics.splice(steady, 0.02)
    assert out["splices"] == 5 and out["disagreement"]["max"] == pytest.approx(0.0)
    assert out["jerk"]["max"] == pytest.approx(0.0) and out["splice_jerk"]["n"] == 5
    jumpy = [tick(40 * i, 1.0, {"act": 1.0}, actions=2 * i + 0.5 * (i % 2) + ramp, compare=2 * i + ramp)
             for i in range(6)]
    out = metrics.splice(jumpy, 0.02)
    assert out["disagreement"]["p50"] == pytest.approx(0.5) and out["disagreement"]["n"] == 5
    dt3 = 0.02 ** 3
    # executed: 0, 1, 2.5, 3.5, 4, 5, 6.5, ...: the window 0, 1, 2.5, 3.5 around the first splice has a third
    # difference of 3.5 - 3 * 2.5 + 3 * 1 - 0 = -1
    assert out["splice_jerk"]["max"] == pytest.approx(1.0 / dt3, rel=1e-6)
    assert len(out["series"]["t_s"]) == 5 and out["series"]["t_s"][0] == pytest.approx(0.04)
    compare = metrics.splice(jumpy, 0.02, index=0)  # the compare runtime's chunks: the steady plan
    assert compare["disagreement"]["max"] == pytest.approx(0.0)
    assert metrics.splice(jumpy[:1], 0.02) == {"action_dt_s": 0.02, "splices": 0}


def test_a_stage_that_misses_most_of_its_deadlines_is_warned_about():
    from flashrt_ros.replay.report import Report

    stages = {"act": {"n": 10, "p50": 26.5, "p90": 30.0, "p99": 31.0, "max": 31.0, "period_ms": 20.0,
                      "deadline_misses": 9},
              "observe": {"n": 4, "p50": 30.0, "p90": 30.0, "p99": 30.0, "max": 300.0, "period_ms": 100.0,
                          "deadline_misses": 1}}
    lines = Report(data={"stages": stages}, ticks=[], recorded=[], pairs=[], joint_names=()).result_lines()
    assert lines == ["warning: act took longer than its period in 9 of 10 runs (p50 26.5 ms, period 20.0 ms): this "
                     "machine does not hold the contract's rate"]


def test_refusals_group_by_kind_and_input_not_by_their_numbers():
    why = "observation age {} ms exceeds limits.max_observation_age_ms = 250; stale input: /cam{}/image_raw ({} ms)"
    ticks = [tick(0, 1.0, actions=np.ones((2, 2)), age=10.0)]
    ticks += [tick(20 * k, 1.0, reason=why.format(250 + 20 * k, 1, 250 + 20 * k)) for k in range(1, 5)]
    ticks += [tick(100 + 20 * k, 1.0, reason=why.format(300 + k, 0, 300 + k)) for k in range(1, 3)]
    groups = metrics.staleness(ticks, 250.0)["refusals"]
    assert [(g["count"], g["first_s"], g["last_s"]) for g in groups] == [(4, 0.02, 0.08), (2, 0.12, 0.14)]
    assert "/cam1/" in groups[0]["reason"] and "/cam0/" in groups[1]["reason"]


def test_a_contract_that_names_its_checkpoint_keeps_its_action_width(tmp_path):
    from flashrt_ros.runtime_loader import model_widths, names_checkpoint

    named, bare, broken = tmp_path / "named.yaml", tmp_path / "bare.yaml", tmp_path / "broken.yaml"
    named.write_text("model:\n  checkpoint: /models/pi05\n")
    bare.write_text("model:\n  checkpoint: null\n")
    broken.write_text("model: [unclosed\n")
    assert names_checkpoint(named) and not names_checkpoint(bare) and not names_checkpoint(broken)
    assert not names_checkpoint(tmp_path / "missing.yaml")
    joints = ["a", "b", "c"]
    assert model_widths(joints, checkpoint=names_checkpoint(named)) == {"state_dim": 3}
    assert model_widths(joints, checkpoint=names_checkpoint(bare)) == {"state_dim": 3, "action_dim": 3}
