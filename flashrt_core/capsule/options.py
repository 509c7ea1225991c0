"""A runtime's capsule options: memory budget per tier (MB), what to do when a tier is full, the disk folder.

Defaults are sized for a robot (Jetson AGX Thor, 128 GB shared by CPU and GPU; or one datacenter GPU). A
full-size pi0.5 capsule is about 17 MB (bf16 prefix K/V of 18 layers x 968 tokens, the chunk, the prompt):
- device 1024 MB: ~60 capsules, beside a ~7 GB model, its graphs and workspace. A script that snapshots
  every decision and never drops fills it in a second at 50 Hz, so the cap is what keeps that from
  taking the engine's memory;
- host 2048 MB: pinned memory, which the OS can neither page out nor give to other processes, so kept to a
  small share of a robot's 32-128 GB;
- disk 10240 MB: ~600 capsules, a long session of kept states, without filling a robot's SSD.
1 MB here is 2**20 bytes. `None` for a tier means no bound (the Python API only).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Mapping

from flashrt_core.errors import CapsuleError

MIB = 2 ** 20
DEFAULT_BUDGET_MB = {"device": 1024, "host": 2048, "disk": 10240}
EVICTIONS = {"none": "refuse", "oldest": "drop_oldest"}  # option -> what the store does when a tier is full


def mb_text(nbytes: int) -> str:
    """Bytes as MB for messages: 1 decimal from 1 MB on, 4 below (a tiny model's capsule is ~0.2 MB)."""
    mb = nbytes / MIB
    return f"{mb:.1f} MB" if mb >= 1 else f"{mb:.4f} MB"


@dataclasses.dataclass(frozen=True)
class CapsuleOptions:
    budget_mb: Mapping[str, float | None]  # tier -> MB (None: no bound)
    eviction: str = "none"  # none: refuse a capsule that does not fit; oldest: drop the tier's oldest
    capsule_dir: pathlib.Path | None = None  # disk tier kept across restarts (None: a temporary folder)

    def budget_bytes(self) -> dict:
        return {tier: None if mb is None else int(mb * MIB) for tier, mb in self.budget_mb.items()}

    @property
    def on_full(self) -> str:
        return EVICTIONS[self.eviction]


def capsule_options(budget_mb: Mapping | None = None, eviction: str = "none", capsule_dir=None) -> CapsuleOptions:
    """Checked options; tiers missing from `budget_mb` get DEFAULT_BUDGET_MB. CapsuleError names a bad one."""
    budget = dict(DEFAULT_BUDGET_MB)
    if budget_mb is not None:
        if not isinstance(budget_mb, Mapping):
            raise CapsuleError(f"capsule_budget_mb: expected a dict of tier -> MB, got {type(budget_mb).__name__}")
        unknown = sorted(set(map(str, budget_mb)) - set(DEFAULT_BUDGET_MB))
        if unknown:
            raise CapsuleError(f"capsule_budget_mb: unknown tier(s) {unknown}; tiers are {list(DEFAULT_BUDGET_MB)}")
        for tier, mb in budget_mb.items():
            if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float))
                                   or not math.isfinite(mb) or mb < 0):
                raise CapsuleError(f"capsule_budget_mb[{tier!r}]: expected MB >= 0 or None, got {mb!r}")
            budget[tier] = mb
    if eviction not in EVICTIONS:
        raise CapsuleError(f"capsule_eviction: expected one of {list(EVICTIONS)}, got {eviction!r}")
    folder = None
    if capsule_dir not in (None, ""):
        folder = pathlib.Path(capsule_dir).expanduser()
        if folder.exists() and not folder.is_dir():
            raise CapsuleError(f"capsule_dir: {folder} exists and is not a folder")
    return CapsuleOptions(budget, eviction, folder)
