"""Capsules under operation on the tiny pi0.5 Runtime: budgets per tier, eviction of the oldest, bounded
replies for unknown ids, a disk tier that outlives the runtime, and ISO 8601 times where users read them."""
import json
import re

import numpy as np
import pytest
import torch

from flashrt_core.capsule import capsule_inspect, diskfmt
from flashrt_core.capsule.options import DEFAULT_BUDGET_MB, MIB
from flashrt_core.capsule.timefmt import iso_utc
from flashrt_core.contract.runtime import Runtime
from flashrt_core.errors import CapsuleError

# Tolerance table: capsules copy bytes, so restored buffers compare bitwise.
TOLERANCE = {"restored_buffers_max_abs": 0.0}

CONFIG = "config/pi05_tiny.yaml"
MS = 1_000_000
TICK_MS = 20
PROMPT = "pick up the red cube"
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def observation(tick):
    rng = np.random.default_rng(2000 + tick)
    images = [rng.integers(1, 255, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    return images, rng.standard_normal(8).astype(np.float32) + 0.1


def run_ticks(rt, ticks):
    for t in ticks:
        images, state = observation(t)
        rt.set_observation(images=images, state=state, stamp_ns=t * TICK_MS * MS)
        rt.step(t * TICK_MS * MS + MS)


def make_runtime(seed=0, **capsules):
    rt = Runtime.from_config(CONFIG, device="cpu", seed=seed, **capsules)
    rt.set_prompt(PROMPT)
    return rt


def state(rt):
    return {k: v.clone() for k, v in rt.persistent_buffers().items()}


def host_state(rt):
    meta = rt.runtime_meta()
    return ({k: v for k, v in meta.items() if k not in ("rng_state", "prompt_bytes")}, meta["rng_state"].tolist())


def assert_state(rt, want):
    for k, v in rt.persistent_buffers().items():
        assert torch.equal(v, want[k]), f"buffer {k} differs"


@pytest.fixture(scope="module")
def capsule_mb():
    rt = make_runtime()
    rt.warmup()
    return rt.capsules.capsule_bytes / MIB


def test_the_default_budgets_are_the_robot_sized_ones():
    rt = make_runtime()
    rt.warmup()
    assert DEFAULT_BUDGET_MB == {"device": 1024, "host": 2048, "disk": 10240}
    assert rt.capsules.budgets == {t: mb * MIB for t, mb in DEFAULT_BUDGET_MB.items()}
    assert rt.capsules.on_full == "refuse"
    partial = make_runtime(capsule_budget_mb={"host": 3, "disk": None})  # missing tiers keep their default
    partial.warmup()
    assert partial.capsules.budgets == {"device": 1024 * MIB, "host": 3 * MIB, "disk": None}


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_a_snapshot_over_budget_is_refused_naming_tier_budget_and_holdings(tier, capsule_mb, tmp_path):
    rt = make_runtime(capsule_budget_mb={tier: 2.5 * capsule_mb}, capsule_dir=tmp_path / "caps")
    rt.warmup()
    held, states = [], []
    for i in range(2):
        run_ticks(rt, range(3 * i, 3 * i + 3))
        held.append(rt.snapshot(f"s{i}", tier=tier))
        states.append(state(rt))
    run_ticks(rt, range(6, 8))
    live, host, rows = state(rt), host_state(rt), rt.list_capsules()
    budget, holds = 2.5 * capsule_mb, 2 * capsule_mb
    with pytest.raises(CapsuleError) as err:
        rt.snapshot("third", tier=tier)
    message = str(err.value)
    assert message.startswith(f"snapshot 'third': the {tier} tier is full: its budget of {budget:.4f} MB holds "
                              f"2 capsule(s), {holds:.4f} MB ({held[1]}, {held[0]})"), message
    assert f"this capsule needs {capsule_mb:.4f} MB" in message and "capsule_eviction" in message
    assert_state(rt, live)  # the live state and the held capsules are untouched
    assert host_state(rt) == host
    assert rt.list_capsules() == rows
    for cid, want in zip(held, states):
        rt.restore(cid)
        assert_state(rt, want)
    with pytest.raises(CapsuleError, match=f"more than the whole {tier} budget"):
        make_runtime(capsule_budget_mb={tier: 0.5 * capsule_mb}, capsule_dir=tmp_path / "small").snapshot("x", tier)


def test_eviction_oldest_drops_the_oldest_capsules_of_that_tier_only(capsule_mb):
    rt = make_runtime(capsule_budget_mb={"device": 2.5 * capsule_mb}, capsule_eviction="oldest")
    rt.warmup()
    run_ticks(rt, range(2))
    on_host = rt.snapshot("on host", tier="host")
    ids, states = [], []
    for i in range(3):
        run_ticks(rt, range(2 + 2 * i, 4 + 2 * i))
        ids.append(rt.snapshot(f"d{i}", tier="device"))
        states.append(state(rt))
        assert rt.capsules.last_dropped == ([] if i < 2 else [ids[0]])
    assert [r["id"] for r in rt.list_capsules()] == [on_host, ids[1], ids[2]]
    for cid, want in zip(ids[1:], states[1:]):
        rt.restore(cid)
        assert_state(rt, want)
    with pytest.raises(CapsuleError, match=f"unknown capsule id '{ids[0]}'"):
        rt.restore(ids[0])
    fork = rt.fork(ids[2], "branch")  # a fork makes room the same way, never by dropping its own source
    assert rt.capsules.last_dropped == [ids[1]]
    rt.restore(fork)
    assert_state(rt, states[2])


def test_bad_capsule_options_are_refused_by_name():
    for kwargs, field in (({"capsule_budget_mb": {"gpu": 1}}, "unknown tier"),
                          ({"capsule_budget_mb": {"device": -1}}, r"capsule_budget_mb\['device'\]"),
                          ({"capsule_budget_mb": {"host": "lots"}}, r"capsule_budget_mb\['host'\]"),
                          ({"capsule_eviction": "lru"}, "capsule_eviction")):
        with pytest.raises(CapsuleError, match=field):
            Runtime.from_config(CONFIG, device="cpu", **kwargs)


def test_an_unknown_id_lists_only_the_newest_few(tmp_path):
    rt = make_runtime()
    run_ticks(rt, range(2))
    ids = [rt.snapshot(f"s{i}", tier="host") for i in range(12)]
    for verb in (lambda: rt.restore("nope"), lambda: rt.drop_capsule("nope"),
                 lambda: rt.export_capsule("nope", tmp_path / "x"), lambda: rt.fork("nope", "f")):
        with pytest.raises(CapsuleError) as err:
            verb()
        message = str(err.value)
        assert message == f"unknown capsule id 'nope' (known: {', '.join(reversed(ids[-5:]))} and 7 more)"
        assert ids[0] not in message
    assert not (tmp_path / "x").exists()


def test_the_capsule_dir_lists_its_capsules_again_after_a_restart(tmp_path):
    folder = tmp_path / "caps"
    first = make_runtime(capsule_dir=folder)
    first.warmup()
    run_ticks(first, range(4))
    kept = first.snapshot("kept", tier="disk")
    want, rows = state(first), first.list_capsules()
    first.close()  # the node's cleanup: a folder the user named stays
    other = make_runtime(seed=1)  # other weights: its capsule in the folder is not this runtime's
    run_ticks(other, range(2))
    other.export_capsule(other.snapshot("foreign", tier="host"), folder / "foreign")
    # this runtime's capsules whose buffers file was deleted, or cut short, are not listed again either
    import shutil
    shutil.copytree(folder / kept, folder / "gone")
    (folder / "gone" / "buffers.safetensors").unlink()
    shutil.copytree(folder / kept, folder / "short")
    with (folder / "short" / "buffers.safetensors").open("r+b") as f:
        f.truncate(100)

    again = make_runtime(capsule_dir=folder)  # not warmed up: listing opens the folder
    listed = again.list_capsules()
    assert [(r["id"], r["name"], r["tier"], r["decision_id"]) for r in listed] == [(kept, "kept", "disk", 4)]
    assert listed[0]["created_utc"] == rows[0]["created_utc"] and ISO.match(listed[0]["created_utc"])
    skipped = dict(s.split(": ", 1) for s in again.capsules.relist_skipped)
    assert sorted(skipped) == ["foreign", "gone", "short"] and "weights_digest" in skipped["foreign"]
    assert skipped["gone"] == "buffers.safetensors is missing"
    assert skipped["short"].startswith("buffers.safetensors is cut short (100 bytes")
    run_ticks(again, range(6))
    again.restore(kept, rewind_time=True)
    assert_state(again, want)
    new = again.snapshot("new", tier="disk")
    assert new != kept and {r["id"] for r in again.list_capsules()} == {kept, new}
    again.drop_capsule(kept)
    assert not (folder / kept).exists() and (folder / "foreign").is_dir() and (folder / "gone").is_dir()


def _rewrite_manifest(folder, edit):
    path = folder / diskfmt.MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    manifest["manifest_sha256"] = diskfmt._manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


def test_times_are_iso_8601_in_manifests_listings_and_inspect_and_old_manifests_still_read(tmp_path, capsys):
    rt = make_runtime()
    run_ticks(rt, range(2))
    cid = rt.snapshot("x", tier="host")
    row = rt.list_capsules()[0]
    assert ISO.match(row["created_utc"]) and row["created_utc"] == iso_utc(row["created"])
    rt.export_capsule(cid, tmp_path / "new")
    manifest = json.loads((tmp_path / "new" / diskfmt.MANIFEST).read_text())
    assert manifest["created"] == row["created_utc"]
    assert capsule_inspect(tmp_path / "new") == 0
    assert f"created: {row['created_utc']}" in capsys.readouterr().out

    # A manifest from before: the time in Unix seconds. It still inspects, imports and relists, shown in ISO.
    rt.export_capsule(cid, tmp_path / "old" / "c-old")
    _rewrite_manifest(tmp_path / "old" / "c-old", lambda m: m.update(created=1796412000.25))
    assert capsule_inspect(tmp_path / "old" / "c-old") == 0
    assert "created: 2026-12-04T19:20:00.250Z" in capsys.readouterr().out
    assert rt.import_capsule(tmp_path / "old" / "c-old") in [r["id"] for r in rt.list_capsules()]
    relisted = make_runtime(capsule_dir=tmp_path / "old").list_capsules()
    assert [(r["id"], r["created_utc"]) for r in relisted] == [("c-old", "2026-12-04T19:20:00.250Z")]

    _rewrite_manifest(tmp_path / "new", lambda m: m.update(created="yesterday"))
    assert capsule_inspect(tmp_path / "new") == 1
    assert "not an ISO 8601 time" in capsys.readouterr().out
