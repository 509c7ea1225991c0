"""A loopback-only ROS environment for the demo, tests and replay: no DDS traffic leaves the machine."""
from __future__ import annotations

import os
import random
import tempfile


def isolated_env(base: dict | None = None, domain_id: int | None = None) -> dict:
    """A copy of the environment (LD_LIBRARY_PATH and the wheel bootstrap flag included) that keeps
    discovery on localhost, in a random domain unless one is set, with a writable log dir."""
    env = dict(os.environ if base is None else base)
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = env.get("ROS_AUTOMATIC_DISCOVERY_RANGE") or "LOCALHOST"
    if domain_id is not None:
        env["ROS_DOMAIN_ID"] = str(domain_id)
    elif not env.get("ROS_DOMAIN_ID"):
        env["ROS_DOMAIN_ID"] = str(random.randint(1, 200))
    if not env.get("ROS_LOG_DIR"):
        env["ROS_LOG_DIR"] = tempfile.mkdtemp(prefix="flashrt_roslog_")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def apply_isolated_env() -> dict:
    """Make this process's own environment loopback-only (before rclpy.init)."""
    env = isolated_env()
    for key in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "ROS_DOMAIN_ID", "ROS_LOG_DIR"):
        os.environ[key] = env[key]
    return env
