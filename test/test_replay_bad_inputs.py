"""Bad bags give a ReplayError that names the bag, topic or message, and a partial report of what was read:
truncated files (mcap and sqlite3), a missing topic, an empty bag, header stamps going back, a camera topic
of an unknown message type."""
import json
import pathlib

import numpy as np
import pytest
import yaml

from flashrt_ros.replay import bagio
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.make_bag import sensor_events
from flashrt_ros.replay.replay import replay
from flashrt_ros.replay.topics import TopicMap

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
ACT_HZ, OBSERVE_HZ = 10, 5
H, W = 48, 64
FRAME_DEF = "uint32 width\nuint32 height\nuint8[] pixels\n"


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    data = yaml.safe_load(CONFIG.read_text())
    data["stages"]["act"]["trigger"]["rate_hz"] = ACT_HZ
    data["stages"]["observe"]["trigger"]["rate_hz"] = OBSERVE_HZ
    path = tmp_path_factory.mktemp("contract") / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_bag(path, storage="mcap", duration=1.0, drop=(), edit=None, frame_type_on=None, empty=False):
    """Synthetic sensors (no recorded actions) straight through the rosbags writer; `edit(topic, seq, msg)`
    may change a message, `frame_type_on` gives that topic an unknown custom type."""
    store = bagio.typestore()
    topics = TopicMap()
    writer = bagio.open_writer(path, storage)
    with writer:
        conns = {}
        for topic, msgtype in [(t, bagio.IMAGE) for t in topics.cameras] + [
                (topics.joint_states, bagio.JOINT_STATE), (topics.prompt, bagio.STRING)]:
            if topic in drop:
                continue
            if topic == frame_type_on:
                conns[topic] = writer.add_connection(topic, "acme_msgs/msg/Frame", msgdef=FRAME_DEF,
                                                     rihs01="RIHS01_" + "0" * 64)
            else:
                conns[topic] = writer.add_connection(topic, msgtype, typestore=store)
        if empty:
            return path
        seq = {}
        for ns, _, _, topic, msgtype, msg in sensor_events(store, topics, duration, H, W, 8, "stack the cups"):
            if topic not in conns:
                continue
            seq[topic] = seq.get(topic, -1) + 1
            if edit is not None:
                msg = edit(topic, seq[topic], msg)
            data = store.serialize_cdr(msg, msgtype) if topic != frame_type_on else b"\x00\x01\x00\x00" + bytes(12)
            writer.write(conns[topic], ns, data)
    return path


def storage_file(bag):
    return next(p for p in bag.iterdir() if p.suffix in (".mcap", ".db3"))


def expect_error(bag, contract, report_dir, match):
    with pytest.raises(ReplayError, match=match) as info:
        replay(bag, config=contract, report_dir=report_dir, progress=False)
    err = info.value
    assert isinstance(err, ValueError) and err.report is not None and err.report_dir == report_dir
    on_disk = json.loads((report_dir / "report.json").read_text())
    assert on_disk["status"] == "error" and on_disk["error"] == str(err)
    assert (report_dir / "report.md").read_text().startswith("# Replay report")
    return err


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_truncated_bag_replays_what_is_intact_then_fails(tmp_path, contract, storage):
    bag = write_bag(tmp_path / "bag", storage)
    f = storage_file(bag)
    with f.open("r+b") as fh:
        fh.truncate(int(f.stat().st_size * 0.6))
    err = expect_error(bag, contract, tmp_path / "report", r"corrupt or truncated bag after bag time")
    d = err.report.data
    assert d["bag"]["damage"]  # why rosbags refused it
    assert 0 < d["ticks"] < ACT_HZ + 1 and d["decisions"] == d["ticks"]
    assert d["stages"]["act"]["n"] == d["ticks"]
    assert (tmp_path / "report" / "latency.png").is_file()


def test_file_cut_before_any_message_is_refused_without_ticks(tmp_path, contract):
    bag = write_bag(tmp_path / "bag", "mcap")
    f = storage_file(bag)
    with f.open("r+b") as fh:
        fh.truncate(40)
    err = expect_error(bag, contract, tmp_path / "report", r"cannot open bag \(corrupt or truncated\)")
    assert err.report.data["ticks"] == 0


def test_a_folder_that_is_no_bag_is_named_as_such(tmp_path, contract):
    folder = tmp_path / "not_a_bag"
    folder.mkdir()
    (folder / "notes.txt").write_text("recorded on tuesday")
    err = expect_error(folder, contract, tmp_path / "report", r"not a rosbag2 bag \(a folder with no metadata.yaml")
    assert err.report.data["ticks"] == 0


def test_missing_topic_lists_the_topics_present(tmp_path, contract):
    bag = write_bag(tmp_path / "bag", "sqlite3", drop=("/joint_states",))
    err = expect_error(bag, contract, tmp_path / "report", r"missing topic\(s\) /joint_states; the bag has: ")
    assert "/camera0/image_raw (sensor_msgs/msg/Image, 31 msgs)" in str(err)
    assert "/policy_node/prompt (std_msgs/msg/String, 1 msgs)" in str(err)
    assert sorted(err.report.data["bag"]["topics"]) == ["/camera0/image_raw", "/camera1/image_raw",
                                                        "/policy_node/prompt"]


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_empty_bag(tmp_path, contract, storage):
    bag = write_bag(tmp_path / "bag", storage, empty=True)
    err = expect_error(bag, contract, tmp_path / "report", r"the bag is empty \(0 messages")
    assert err.report.data["ticks"] == 0 and err.report.data["bag"]["message_count"] == 0


def test_header_stamp_going_back_stops_with_the_ticks_before_it(tmp_path, contract):
    def back_in_time(topic, seq, msg):
        if topic == "/joint_states" and seq == 100:  # logged at 0.5 s, stamped 50 ms before the previous one
            msg.header.stamp.nanosec -= 55_000_000
        return msg

    bag = write_bag(tmp_path / "bag", "mcap", edit=back_in_time)
    err = expect_error(bag, contract, tmp_path / "report",
                       r"timestamps out of order: /joint_states message #100 header stamp .* 50\.000 ms older")
    d = err.report.data
    assert d["ticks"] == 5 and d["decisions"] == 5  # ticks at 0.0 .. 0.4 s ran before the bad message
    assert d["action_error"]["note"] == "the bag has no recorded actions"


def test_camera_topic_of_unknown_type(tmp_path, contract):
    bag = write_bag(tmp_path / "bag", "mcap", frame_type_on="/camera1/image_raw")
    expect_error(bag, contract, tmp_path / "report",
                 r"topic /camera1/image_raw has message type acme_msgs/msg/Frame \(a message type this replay "
                 r"does not know\), expected sensor_msgs/msg/Image or sensor_msgs/msg/CompressedImage")


def test_bag_that_does_not_exist(tmp_path, contract):
    with pytest.raises(ReplayError, match="no such bag"):
        replay(tmp_path / "nope", config=contract, progress=False)


def test_a_replay_in_which_every_decision_is_refused_is_an_error(tmp_path, contract):
    """Camera frames stamped a second behind the bag clock (a driver's clock offset): every due decision is
    refused for age. That is a failed replay (status error, a non-zero exit), not 'status ok, 0 decisions'."""
    def late(topic, seq, msg):
        if topic.startswith("/camera"):
            msg.header.stamp.sec -= 1
        return msg

    bag = write_bag(tmp_path / "bag", "mcap", edit=late)
    err = expect_error(bag, contract, tmp_path / "report", r"no decisions: all \d+ due decisions were refused "
                                                           r"\(most: observation age .* exceeds")
    assert err.report.data["decisions"] == 0 and err.report.data["ticks"] > 5
    assert "refused decisions:" in err.report.summary_table()


def test_a_report_folder_is_replaced_whole_and_a_file_in_its_way_is_refused(tmp_path, contract):
    bag = write_bag(tmp_path / "bag", "mcap")
    out = tmp_path / "report"
    out.mkdir()
    (out / "actions.png").write_bytes(b"an older run's plot")
    (out / "notes.txt").write_text("older")
    report = replay(bag, config=contract, report_dir=out, progress=False)
    assert report.ok and sorted(p.name for p in out.iterdir()) == sorted(
        ["report.json", "report.md", "actions.npz", "latency.png", "observation_age.png", "actions.png", "splices.png"])
    assert (out / "actions.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".report.")]  # no temporary folders left
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(ReplayError, match="exists and is not a folder"):
        replay(bag, config=contract, report_dir=blocked, progress=False)
    assert blocked.read_text() == "x"


def test_realtime_refuses_options_it_would_ignore(tmp_path, contract):
    for extra in ({"compare": contract}, {"device": "cuda"}, {"tokenizer": "tokenizer.json"}):
        with pytest.raises(ReplayError, match="--compare, --device and --tokenizer apply to the bag-clock replay"):
            replay(tmp_path / "bag", config=contract, realtime=True, progress=False, **extra)


def test_a_compare_contract_with_other_actions_is_refused_up_front(tmp_path, contract):
    data = yaml.safe_load(contract.read_text())
    data["model"]["options"]["action_dim"] = 5
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(data, sort_keys=False))
    bag = write_bag(tmp_path / "bag", "mcap")
    with pytest.raises(ReplayError, match=r"compare contract #1: its actions are \[50, 5\], the main contract's "
                                          r"\[50, 7\]"):
        replay(bag, config=contract, compare=other, progress=False)


def test_bad_messages_are_refused_as_the_node_refuses_them_and_stale_inputs_are_named(tmp_path, contract):
    """NaN joint positions for 0.3 s and a camera that stops at 0.5 s: the replay goes on (the last good joints
    stay in use, as in the node), notes the refused messages by topic and joint name, groups the refusals by the
    input that made them (the stale camera's into one line), and lists every due tick in decisions_table: a decision
    with its whole chunk, or a refusal with its reason."""
    import math

    def damage(topic, seq, msg):
        if topic == "/joint_states" and 40 <= seq < 100:  # 0.2 .. 0.5 s at 200 Hz
            msg.position[2] = math.nan
        return msg

    def stop_camera1(topic, seq, msg):
        return None if topic == "/camera1/image_raw" and seq > 15 else msg

    bag = tmp_path / "bag"
    store = bagio.typestore()
    topics = TopicMap()
    with bagio.open_writer(bag, "mcap") as writer:
        conns = {t: writer.add_connection(t, m, typestore=store) for t, m in
                 [(t, bagio.IMAGE) for t in topics.cameras] + [(topics.joint_states, bagio.JOINT_STATE),
                                                                (topics.prompt, bagio.STRING)]}
        seq = {}
        for ns, _, _, topic, msgtype, msg in sensor_events(store, topics, 1.5, H, W, 8, "stack the cups"):
            seq[topic] = seq.get(topic, -1) + 1
            msg = stop_camera1(topic, seq[topic], damage(topic, seq[topic], msg))
            if msg is not None:
                writer.write(conns[topic], ns, store.serialize_cdr(msg, msgtype))
    report = replay(bag, config=contract, report_dir=tmp_path / "report", progress=False)
    d = report.data
    assert d["status"] == "ok" and d["decisions"] > 0
    notes = [n for n in d["input_notes"] if n.startswith("/joint_states")]
    assert notes == ["/joint_states: 60 message(s) refused, #40..#99 (first: JointState has non-finite positions "
                     "for ['joint2']); the last good one stayed in use"], d["input_notes"]
    # two kinds of refusal, each naming its input: the observation taken while the joints were refused (its
    # joints 0.3 s old by 0.5 s), then every tick after camera1 stopped (its age grows: one group)
    s = d["staleness"]
    assert [g["reason"].split("; stale input: ")[1].split(" ")[0] for g in s["refusals"]] == \
        ["/camera1/image_raw", "/joint_states"], s["refusals"]
    cam, joints = s["refusals"]
    assert cam["count"] + joints["count"] == s["refused"] and joints["count"] == 1 and joints["first_s"] == 0.5
    assert 0.5 < cam["first_s"] < cam["last_s"] <= 1.5 and cam["count"] >= 8
    text = (tmp_path / "report" / "report.md").read_text()
    assert f"refused {cam['count']}x from {cam['first_s']:.2f} to {cam['last_s']:.2f} s: " in text
    rows = d["decisions_table"]
    made = [r for r in rows if "chunk" in r]
    assert [r["chunk"] for r in made] == list(range(d["decisions"])) and len(rows) - len(made) == s["refused"]
    saved = np.load(tmp_path / "report" / "actions.npz")
    assert saved["actions"].shape == (d["decisions"], 50, 7) and np.isfinite(saved["actions"]).all()
    np.testing.assert_array_equal(saved["t_s"], [r["t_s"] for r in made])
    np.testing.assert_array_equal(saved["actions"][-1], report.ticks[-1].actions if report.ticks[-1].actions
                                  is not None else [t.actions for t in report.ticks if t.actions is not None][-1])
    assert sum("stale input: /camera1/image_raw" in r["refused"] for r in rows if "refused" in r) == cam["count"]



def test_named_joints_set_the_models_widths_as_in_the_node(tmp_path, contract):
    """A params file naming 7 of the bag's 8 joints (the packaged policy_node.yaml): the replay builds the model
    the node builds from it (state and action width 7: `runtime_loader.model_widths`), where it used to stop at
    the first joint message (7 joints, a state of 8)."""
    bag = write_bag(tmp_path / "bag", "mcap")
    params = pathlib.Path(__file__).resolve().parents[1] / "config" / "policy_node.yaml"
    report = replay(bag, config=contract, progress=False, topics=str(params))
    assert report.data["status"] == "ok" and report.data["decisions"] > 0
    assert report.data["topics"]["joint_names"] == [f"joint{i}" for i in range(7)]
    assert all(t.actions.shape[1] == 7 for t in report.ticks if t.actions is not None)
