"""`replay(bag, config)`: a recorded bag through the Runtime on the bag clock, and its report.

The default mode needs no ROS graph and is deterministic: the same bag, contract and seed give the same
actions, so actions recorded by make-bag (or by an earlier replay) are reproduced exactly, and two contracts
fed the same inputs and noise can be compared decision by decision. `realtime=True` plays the bag onto ROS
topics against a running policy_node instead (flashrt_ros.replay.realtime).
"""
from __future__ import annotations

import time
from pathlib import Path

from flashrt_ros.replay.bagio import BagSource
from flashrt_ros.replay.errors import ReplayError
from flashrt_ros.replay.player import BagClockPlayer
from flashrt_ros.replay.progress import Progress
from flashrt_ros.replay.report import Report, build_report
from flashrt_ros.replay.runtimes import build_runtime, default_config
from flashrt_ros.replay.topics import TopicMap, load_topic_map


def _topic_map(topics) -> TopicMap:
    if topics is None:
        return TopicMap()
    if isinstance(topics, TopicMap):
        return topics
    if isinstance(topics, dict):
        return load_topic_map(None, **topics)
    return load_topic_map(topics)


def replay(bag, config=None, compare=None, report_dir=None, realtime: bool = False, seed: int = 0,
           progress: bool = True, topics=None, prompt: str | None = None, device: str = "cpu",
           node: str = "/policy_node", timeout_s: float = 60.0, action_dt_s: float = 0.02,
           checkpoint: str | None = None, tokenizer: str | None = None) -> Report:
    """Replay `bag` through `config` (default: the packaged contract a node takes, pi05_tiny.yaml without a
    checkpoint) and return the Report. checkpoint: the contract's model.checkpoint (as the node's parameter);
    tokenizer: its tokenizer file or folder (as the node's parameter; default: the hub cache).

    topics: a TopicMap, a dict of its fields, or a mapping/params YAML path (default: make-bag's names).
    prompt: use this prompt instead of the bag's prompt topic. action_dt_s: seconds between two actions of a
    chunk on the robot (the node's action_dt), for the splice metrics. On a bad bag, raises ReplayError
    carrying the partial report (also written to report_dir).
    """
    config = Path(config) if config is not None else default_config(checkpoint)
    topic_map = _topic_map(topics)
    if realtime:
        from flashrt_ros.replay.realtime import replay_realtime

        if compare is not None or device != "cpu" or tokenizer is not None:  # (the node has its own)
            raise ReplayError("--compare, --device and --tokenizer apply to the bag-clock replay; --realtime "
                              "drives a running policy_node, whose parameters set them")
        return replay_realtime(bag, config, report_dir=report_dir, topics=topic_map, prompt=prompt, node=node,
                               progress=progress, seed=seed, timeout_s=timeout_s, action_dt_s=action_dt_s,
                               checkpoint=checkpoint)
    cams = len(topic_map.cameras)

    def runtimes():
        joints = topic_map.joint_names  # (named joints set the model's widths, as in the node)
        built = [build_runtime(config, seed=seed, cameras=cams, device=device, checkpoint=checkpoint,
                               joint_names=joints, tokenizer=tokenizer)]
        if compare is not None:
            built.append(build_runtime(compare, seed=seed, cameras=cams, device=device, joint_names=joints))
        return built

    report = bag_clock_report(bag, runtimes, config=config, compare=compare, topic_map=topic_map, seed=seed,
                              prompt=prompt, progress=progress, action_dt_s=action_dt_s)
    error = report.data["error"]  # (also: no decision at all, every one refused)
    if report_dir is not None:
        try:
            report.write(report_dir)
        except ReplayError:
            raise
        except Exception as exc:  # plots of a bag this replay did not foresee: say so, no traceback
            raise ReplayError(f"{bag}: building the report failed ({type(exc).__name__}: {exc})"
                              + (f"; the replay itself had failed: {error}" if error else "")) from exc
    if error:
        raise ReplayError(error, report=report, report_dir=report_dir)
    return report


def bag_clock_report(bag, runtimes, *, config, topic_map: TopicMap, seed: int, compare=None,
                     prompt: str | None = None, progress: bool = False, action_dt_s: float = 0.02) -> Report:
    """The bag-clock replay of `bag` through the runtimes that `runtimes()` returns (the contract under test,
    then the compare one; called once the bag's topics are checked, so a bag that lacks one costs no model
    build), and its report. A bag that cannot be replayed gives the partial report with data["error"] set;
    only a report that cannot be built at all raises ReplayError. `flashrt evaluate` calls this with runtimes
    it built once and rewound to their fresh state."""
    t_wall = time.perf_counter()
    player = contract = bar = None
    error = None
    source = BagSource(bag, topic_map, need_prompt=prompt is None)
    try:
        source.open()
        built = runtimes()
        contract = built[0].contract
        player = BagClockPlayer(built, len(topic_map.cameras), topic_map.joint_names, prompt=prompt)
        player.progress = bar = Progress(source.info.start_ns, source.info.end_ns, enabled=progress)
        for event in source.events():
            player.push(event)
        player.finish()
        if not player.started:
            raise ReplayError(f"{bag}: no complete observation in {player.messages} messages "
                              f"(never received: {', '.join(player.waiting_for())})")
    except ReplayError as e:
        error = str(e)
    finally:
        source.close()
        if bar is not None:
            bar.close(player.last_ns or source.info.start_ns, player.decisions)
    try:
        report = build_report(mode="bag-clock", config=config, seed=seed, topics=topic_map, info=source.info,
                              player=player, contract=contract, compare_config=compare,
                              wall_s=time.perf_counter() - t_wall, error=error, action_dt_s=action_dt_s)
        if player is not None:
            report.data["input_notes"] = list(player.fit.notes) + player.notes()
    except ReplayError:
        raise
    except Exception as exc:  # numbers of a bag this replay did not foresee: say so, no traceback
        raise ReplayError(f"{bag}: building the report failed ({type(exc).__name__}: {exc})"
                          + (f"; the replay itself had failed: {error}" if error else "")) from exc
    return report
