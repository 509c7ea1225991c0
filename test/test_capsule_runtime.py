"""Capsules on the tiny pi0.5 Runtime: a restored or forked branch continues exactly like the undisturbed run.

Three runtimes built alike are fed the same observations on the same simulated clock (observe at 10 Hz, act
at 50 Hz). A runs straight through (the reference). B snapshots after tick K, forks the capsule twice,
exports one fork, is then disturbed (every persistent buffer overwritten, the noise RNG reseeded, an extra
step taken), restores the other fork and continues. C replays the same history, is disturbed, imports the
exported fork (a second process would do the same) and continues. Both continuations must reproduce A's
actions bit for bit, including the observe tick in the middle.
"""
import numpy as np
import pytest
import torch

from flashrt_core.contract.runtime import Runtime
from flashrt_core.errors import CapsuleError

# Tolerance table: restore copies bytes and the RNG state, so continued actions match exactly.
TOLERANCE = {"continued_actions_max_abs": 0.0}

MS = 1_000_000
TICK_MS = 20  # 50 Hz act; observe (10 Hz) runs at ticks 0, 5, ...
K = 3  # snapshot after this tick
TICKS = 9
PROMPT = "pick up the red cube"


def observation(tick):
    rng = np.random.default_rng(1000 + tick)
    images = [rng.integers(1, 255, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    return images, rng.standard_normal(8).astype(np.float32) + 0.1


def run_ticks(rt, ticks):
    out = []
    for t in ticks:
        images, state = observation(t)
        rt.set_observation(images=images, state=state, stamp_ns=t * TICK_MS * MS)
        res = rt.step(t * TICK_MS * MS + MS)
        out.append((tuple(res.ran), res.decision_id, None if res.actions is None else res.actions.copy()))
    return out


def disturb(rt, seed):
    g = torch.Generator().manual_seed(seed)
    for name, t in rt.persistent_buffers().items():
        noise = torch.randint(1, 200, t.shape, generator=g) if not t.dtype.is_floating_point else torch.randn(t.shape, generator=g)
        t.copy_(noise.to(t.dtype).to(t.device))
    rt.generator.manual_seed(seed)
    rt.step(K * TICK_MS * MS + 11 * MS)  # an extra act on the disturbed state moves counters, clocks and RNG


def assert_same_run(got, want):
    assert len(got) == len(want)
    for (ran, did, act), (ran_w, did_w, act_w) in zip(got, want):
        assert ran == ran_w and did == did_w
        assert (act is None) == (act_w is None)
        if act is not None:
            assert np.array_equal(act, act_w), f"tick actions differ: max abs {np.abs(act - act_w).max()}"


def make_runtime(device):
    rt = Runtime.from_config("config/pi05_tiny.yaml", device=device, seed=0)
    rt.set_prompt(PROMPT)
    return rt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_restored_and_forked_branches_continue_like_the_undisturbed_run(tmp_path, device):
    a = make_runtime(device)
    reference = run_ticks(a, range(TICKS))
    assert any("observe" in ran for ran, _, _ in reference[K + 1:])  # the continuation recomputes the prefix too

    b = make_runtime(device)
    assert_same_run(run_ticks(b, range(K + 1)), reference[:K + 1])
    before = {k: v.clone() for k, v in b.persistent_buffers().items()}
    cid = b.snapshot("after_tick_k", tier="device")
    f1, f2 = b.fork(cid, name="branch_1"), b.fork(cid, name="branch_2")
    b.export_capsule(f2, tmp_path / "branch_2")
    rows = {r["id"]: r for r in b.list_capsules()}
    assert rows[f1]["name"] == "branch_1" and rows[f1]["decision_id"] == reference[K][1]

    disturb(b, seed=7)
    assert not torch.equal(b.persistent_buffers()["prefix_k"], before["prefix_k"])
    b.restore(f1)
    for k, v in b.persistent_buffers().items():
        assert torch.equal(v, before[k]), f"buffer {k} not restored"
    assert_same_run(run_ticks(b, range(K + 1, TICKS)), reference[K + 1:])

    c = make_runtime(device)
    run_ticks(c, range(K + 1))
    disturb(c, seed=8)
    imported = c.import_capsule(tmp_path / "branch_2", tier="device")
    c.restore(imported)
    assert_same_run(run_ticks(c, range(K + 1, TICKS)), reference[K + 1:])


def test_runtime_refusals_leave_the_live_state_untouched(tmp_path):
    rt = make_runtime("cpu")
    run_ticks(rt, range(2))
    cid = rt.snapshot("x", tier="host")
    rt.export_capsule(cid, tmp_path / "x")
    live = {k: v.clone() for k, v in rt.persistent_buffers().items()}
    decisions = rt.decisions
    with pytest.raises(CapsuleError, match="unknown capsule id 'c-missing'"):
        rt.restore("c-missing")
    other = Runtime.from_config("config/pi05_tiny.yaml", device="cpu", seed=1)  # other weights
    with pytest.raises(CapsuleError, match="weights_digest"):
        other.import_capsule(tmp_path / "x")
    data = bytearray((tmp_path / "x" / "buffers.safetensors").read_bytes())
    data[-3] ^= 0xFF  # inside the last buffer's bytes
    (tmp_path / "x" / "buffers.safetensors").write_bytes(bytes(data))
    with pytest.raises(CapsuleError, match="checksum failed"):
        rt.import_capsule(tmp_path / "x")
    for k, v in rt.persistent_buffers().items():
        assert torch.equal(v, live[k])
    assert rt.decisions == decisions and [r["id"] for r in rt.list_capsules()] == [cid]
    rt.drop_capsule(cid)
    assert rt.list_capsules() == []


def same_meta(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_meta(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_meta, a, b))
    return type(a) is type(b) and a == b


def _corrupt(meta, how):
    led = meta["ledger"]
    if how == "clock_name":
        meta["clocks"]["other_stage"] = meta["clocks"].pop("act")
    elif how == "ledger_buffers":
        led["buffers"]["other_buffer"] = led["buffers"].pop("prefix_k")
    elif how == "seen_reads":
        led["seen"]["act"]["images"] = 1
    elif how == "rng_size":
        meta["rng_state"] = meta["rng_state"][:-8].clone()
    elif how == "pending":
        meta["pending"] = ["other_stage"]
    elif how == "missing":
        del meta["clocks"]
    elif how == "runs_type":
        led["runs"]["act"] = "3"
    elif how == "prompt_bytes":
        meta["prompt_bytes"] = meta["prompt_bytes"][:5].clone()
    return {"clock_name": "clocks", "ledger_buffers": "ledger.buffers", "seen_reads": "ledger.seen.act",
            "rng_size": "rng_state", "pending": "pending", "missing": "clocks", "runs_type": "ledger.runs.act",
            "prompt_bytes": "prompt_bytes"}[how]


@pytest.mark.parametrize("how", ["clock_name", "ledger_buffers", "seen_reads", "rng_size", "pending", "missing",
                                 "runs_type", "prompt_bytes"])
def test_restore_of_a_meta_that_does_not_fit_is_atomic(how):
    # A meta from another contract (or a damaged one) must be refused before any buffer is copied, so the
    # live buffers and the host state stay exactly as they were (apply_meta would fail half way otherwise).
    rt = make_runtime("cpu")
    run_ticks(rt, range(2))
    cid = rt.snapshot("x", tier="device")
    run_ticks(rt, range(2, 4))  # live state moves on from the capsule
    cap = rt.capsules._caps[cid]
    field = _corrupt(cap.meta, how)
    live = {k: v.clone() for k, v in rt.persistent_buffers().items()}
    host = rt.runtime_meta()
    with pytest.raises(CapsuleError, match=f"restore of capsule {cid}: meta field {field}"):
        rt.restore(cid)
    for k, v in rt.persistent_buffers().items():
        assert torch.equal(v, live[k]), f"buffer {k} was written by a refused restore"
    assert same_meta(rt.runtime_meta(), host)
    assert_same_run(run_ticks(rt, range(4, 6)), run_ticks(_replayed(4), range(4, 6)))


def _replayed(ticks):
    rt = make_runtime("cpu")
    run_ticks(rt, range(ticks))
    return rt


def test_restore_reports_what_it_restored_and_repeats_exactly():
    rt = make_runtime("cpu")
    run_ticks(rt, range(2))
    cid = rt.snapshot("x", tier="device")
    want = {k: v.clone() for k, v in rt.persistent_buffers().items()}
    host = rt.runtime_meta()
    for seed in (3, 4):
        disturb(rt, seed)
        meta = rt.restore(cid, rewind_time=True)  # everything back, the rate clocks and stamp watermark too
        for k, v in rt.persistent_buffers().items():
            assert torch.equal(v, want[k])
        assert same_meta(rt.runtime_meta(), host)
        # The runtime's persistent device buffers live in one arena laid out like the slab: the restore is
        # one span copy for all of them plus one per host-placed buffer (act's `rtc_clock`, `task`).
        groups, singles, _ = rt.capsules._caps[cid].slab.planned[False][1]
        assert sum(len(d) for d, _ in groups) + len(singles) == 3
        assert meta == {"capsule_id": cid, "decisions": host["decisions"], "step": host["step"],
                        "prompt": host["prompt"], "rewind_time": True}
        # the runtime took no references into the capsule's meta: changing the live state leaves it intact
        rt.generator.manual_seed(99)
        rt.buffers.ledger.runs["act"] = 999
        rt.restore(cid, rewind_time=True)
        assert same_meta(rt.runtime_meta(), host)


def test_closing_a_runtime_removes_its_temporary_capsule_folder(tmp_path):
    """Without a configured store the disk tier lives in a temporary folder of the runtime's own: closing the
    runtime (the node's cleanup) removes it with the disk capsules in it; a folder the user named is kept."""
    rt = Runtime.from_config("config/pi05_tiny.yaml", device="cpu", seed=0)
    run_ticks(rt, range(2))
    cid = rt.snapshot("on disk", tier="disk")
    folder = rt.capsules.disk_dir
    assert folder.is_dir() and any(folder.iterdir()) and cid in [c["id"] for c in rt.list_capsules()]
    rt.close()
    assert not folder.exists()
    from flashrt_core.capsule.runtime_verbs import configure_capsules

    mine = Runtime.from_config("config/pi05_tiny.yaml", device="cpu", seed=0)
    configure_capsules(mine, disk_dir=tmp_path)
    run_ticks(mine, range(2))
    kept = mine.snapshot("kept", tier="disk")
    mine.close()
    assert (tmp_path / kept).is_dir()  # a folder the user named keeps its capsules (the export format)
    again = Runtime.from_config("config/pi05_tiny.yaml", device="cpu", seed=0)
    assert again.import_capsule(tmp_path / kept) in [c["id"] for c in again.list_capsules()]  # and reads back
