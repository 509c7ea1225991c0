"""Rosbag replay evaluation: `replay(bag, config)` on the bag clock (or `realtime=True` against a running
policy_node), `make_bag(out)` for a sample bag, reports with latency, staleness and action agreement."""
from flashrt_ros.replay.errors import ReplayError

__all__ = ["ReplayError", "Report", "TopicMap", "load_topic_map", "make_bag", "replay"]

_LAZY = {"replay": "flashrt_ros.replay.replay", "make_bag": "flashrt_ros.replay.make_bag",
         "Report": "flashrt_ros.replay.report", "TopicMap": "flashrt_ros.replay.topics",
         "load_topic_map": "flashrt_ros.replay.topics"}


def __getattr__(name):
    # The CLI imports this package to register its subcommands; numpy, yaml and rosbags load on first use.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
