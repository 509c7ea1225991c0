"""Room in a capsule tier: what a new capsule may cost, and what to do when the tier's budget is full.

`on_full` of a store: 'refuse' (the capsule is refused with what the tier holds), 'evict' (the tier's
oldest capsules move one tier down, device -> host -> disk, so nothing is lost) or 'drop_oldest' (the
tier's oldest capsules are dropped). `plan` works out every step before anything moves, so a refusal
changes nothing; the store then carries the steps out.
"""
from __future__ import annotations

from flashrt_core.capsule.options import mb_text
from flashrt_core.errors import CapsuleError

ON_FULL = ("refuse", "evict", "drop_oldest")
NEXT_TIER = {"device": "host", "host": "disk", "disk": None}
SHOWN_IDS = 5  # ids a message names before "and N more"


def ids_text(ids: list[str], limit: int = SHOWN_IDS) -> str:
    """`ids` (oldest first) newest first: 'c, b, a', or past `limit` the newest `limit` and 'and N more'."""
    if not ids:
        return "none"
    shown = ", ".join(reversed(ids[-limit:]))
    return shown if len(ids) <= limit else f"{shown} and {len(ids) - limit} more"


def _other_files(store, tier: str) -> str:
    other = store.other_disk_bytes() if tier == "disk" else 0
    return f"; other files in {store.disk_dir}: {mb_text(other)}" if other else ""


def plan(store, tier: str, need: int, protect: set, for_what: str) -> list[tuple]:
    """[(capsule, tier to move it to, or None to drop it)] that make `need` bytes fit in `tier`'s budget.

    Raises CapsuleError naming the tier, its budget and what it holds when nothing may make room. The
    steps are in the order to carry them out (deepest tier first, so a moved capsule finds its room)."""
    budget = store.budgets[tier]
    if budget is None:
        return []
    used = store.used(tier)
    free = budget - used
    if need <= free:
        return []
    if need > budget:
        raise CapsuleError(f"{for_what}: needs {mb_text(need)}, more than the whole {tier} budget of "
                           f"{mb_text(budget)} (capsule_budget_mb[{tier!r}])")
    holders = store.holders(tier)
    full = (f"{for_what}: the {tier} tier is full: its budget of {mb_text(budget)} holds {len(holders)} "
            f"capsule(s), {mb_text(used)} ({ids_text([c.id for c in holders])}{_other_files(store, tier)}), "
            f"{mb_text(max(free, 0))} free; this capsule needs {mb_text(need)}")
    if store.on_full == "refuse":
        raise CapsuleError(f"{full}. Drop or move a capsule, raise capsule_budget_mb[{tier!r}], or set "
                           "capsule_eviction to 'oldest' (drops the tier's oldest capsules)")
    victims, freed = [], 0
    for cap in holders:
        if cap.id in protect:
            continue
        victims.append(cap)
        freed += cap.nbytes
        if free + freed >= need:
            break
    else:
        raise CapsuleError(f"{full}; not enough capsules that may be "
                           f"{'dropped' if store.on_full == 'drop_oldest' else 'evicted'}")
    if store.on_full == "drop_oldest":
        return [(cap, None) for cap in victims]
    nxt = NEXT_TIER[tier]
    if nxt is None or (nxt == "disk" and store.disk_dir is None):
        raise CapsuleError(f"{full}; nothing to evict to below the {tier} tier" + (" (no disk_dir)" if nxt else ""))
    deeper = plan(store, nxt, freed, protect | {c.id for c in victims}, for_what)
    return deeper + [(cap, nxt) for cap in victims]
