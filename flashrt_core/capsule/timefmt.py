"""Capsule times as users read them: ISO 8601 in UTC with milliseconds, e.g. 2026-12-04T19:20:00.123Z.

Inside the store a time is a float of Unix seconds (what `time.time()` gives and sorting needs). Manifests
written from 2026-12-05 on hold the ISO text; older ones hold the float, and both read back here.
"""
from __future__ import annotations

import datetime
import math

from flashrt_core.errors import CapsuleError


def iso_utc(unix_s: float) -> str:
    """Unix seconds -> '2026-12-04T19:20:00.123Z'."""
    when = datetime.datetime.fromtimestamp(float(unix_s), tz=datetime.timezone.utc)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def unix_seconds(value, where: str = "created") -> float:
    """A manifest time (ISO 8601 text, or the float of Unix seconds older manifests hold) -> Unix seconds."""
    if isinstance(value, bool):
        raise CapsuleError(f"{where}: expected an ISO 8601 time, got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise CapsuleError(f"{where}: {value!r} is not a time")
        return float(value)
    if isinstance(value, str):
        try:
            when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise CapsuleError(f"{where}: {value!r} is not an ISO 8601 time (e.g. 2026-12-04T19:20:00.123Z)") from None
        if when.tzinfo is None:  # a time without a zone is taken as UTC, as it was written
            when = when.replace(tzinfo=datetime.timezone.utc)
        return when.timestamp()
    raise CapsuleError(f"{where}: expected an ISO 8601 time, got a {type(value).__name__}")
