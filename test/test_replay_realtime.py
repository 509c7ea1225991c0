"""`replay --realtime`: the bag played onto ROS topics against a policy_node process, the chunks it publishes
recorded and reported; and a clear error when no node listens."""
import pathlib

import pytest
import yaml

from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.make_bag import make_bag
from flashrt_ros.replay.replay import replay

pytestmark = pytest.mark.ros

CONFIG = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
DURATION = 2.5


@pytest.fixture
def contract(tmp_path):
    data = yaml.safe_load(CONFIG.read_text())
    data["stages"]["act"]["trigger"]["rate_hz"] = 10
    data["stages"]["observe"]["trigger"]["rate_hz"] = 5
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.slow
def test_realtime_replay_records_what_the_node_publishes(tmp_path, contract, spawn):
    bag = tmp_path / "bag"
    # policy_node takes frames of the contract's size as they are (224x224), so the bag carries those
    make_bag(bag, duration=DURATION, height=224, width=224, config=contract)
    names = ",".join(f'"joint{i}"' for i in range(7))
    spawn("flashrt_ros.policy_node", "--ros-args", "-r", "__node:=policy_node", "-p", "autostart:=true",
          "-p", f"contract:={contract}", "-p", 'camera_topics:=["camera0/image_raw","camera1/image_raw"]',
          "-p", f"joint_names:=[{names}]", "-p", "device:=cpu", "-p", "max_observation_age_ms:=5000.0",
          log=tmp_path / "node.log")
    report = replay(bag, config=contract, realtime=True, report_dir=tmp_path / "report", progress=False,
                    timeout_s=90)
    d = report.data
    assert report.ok and d["mode"] == "realtime" and d["node"] == "/policy_node"
    assert d["messages_sent"] == 2 * (int(DURATION * 30) + 1) + int(DURATION * 200) + 1
    assert d["decisions"] >= 2, (tmp_path / "node.log").read_text()[-2000:]
    assert all(set(key.split("+")) <= {"prompt", "observe", "act"} and "act" in key for key in d["stages"])
    assert d["tick"]["n"] == d["decisions"] and d["tick"]["p50"] > 0
    assert d["staleness"]["n"] == d["decisions"] and d["staleness"]["p50"] >= 0
    assert d["action_error"]["recorded"] == int(DURATION * 10) + 1
    ids = [row["decision_id"] for row in d["decisions_table"]]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert (tmp_path / "report" / "actions.png").is_file()


def test_realtime_without_a_node_says_so(tmp_path, contract):
    from flashrt_ros.replay import bagio
    from flashrt_ros.replay.make_bag import sensor_events
    from flashrt_ros.replay.topics import TopicMap

    store, topics = bagio.typestore(), TopicMap()
    writer = bagio.open_writer(tmp_path / "bag", "mcap")
    with writer:
        conns = {}
        for ns, _, _, topic, msgtype, msg in sensor_events(store, topics, 0.1, 24, 32, 7, "wave"):
            if topic not in conns:
                conns[topic] = writer.add_connection(topic, msgtype, typestore=store)
            writer.write(conns[topic], ns, store.serialize_cdr(msg, msgtype))
    with pytest.raises(ReplayError, match=r"no policy node: nothing subscribes to /nobody_here/prompt") as info:
        replay(tmp_path / "bag", config=contract, realtime=True, node="nobody_here", timeout_s=1.5,
               progress=False, report_dir=tmp_path / "report")
    assert info.value.report.data["status"] == "error" and info.value.report.data["mode"] == "realtime"
