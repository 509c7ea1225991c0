"""CapsuleStore in memory and on disk: restore exactness, fork independence, budgets, the ring, refusals."""
import pytest
import torch

from flashrt_core.capsule import CapsuleStore, fingerprint
from flashrt_core.errors import CapsuleError

# Tolerance table: capsules move bytes, so every comparison is bitwise (0 ULP) on every dtype.
TOLERANCE_ULP = {"restore": 0, "fork": 0, "evicted": 0, "ring": 0}

# Odd shapes, several dtypes, a 0-d and an empty buffer: what a real persistent state mixes.
LAYOUT = {
    "prefix_k": ((2, 3, 17, 8), torch.bfloat16),
    "prefix_v": ((2, 3, 17, 8), torch.bfloat16),
    "chunk": ((1, 5, 7), torch.float32),
    "noise": ((1, 5, 7), torch.float16),
    "counters": ((3,), torch.int64),
    "stamp": ((), torch.float64),
    "valid": ((13,), torch.bool),
    "empty": ((0, 4), torch.float32),
}
NBYTES = sum(torch.empty(s, dtype=d).numel() * d.itemsize for s, d in LAYOUT.values())


def make_state(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in LAYOUT.items():
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g) + 0.25
        elif dtype == torch.bool:
            t = torch.rand(shape, generator=g) > 0.5
        else:
            t = torch.randint(1, 10_000, shape, generator=g)
        out[name] = t.to(dtype).to(device)
    return out


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), f"buffer {k} differs"


def clone(state):
    return {k: v.clone() for k, v in state.items()}


def dirty(live, seed):
    for k, v in make_state(seed, live[next(iter(live))].device).items():
        live[k].copy_(v)


FP = fingerprint("pi05-tiny", "sha256:abc", "bfloat16", {k: (s, d) for k, (s, d) in LAYOUT.items()})


def store(tmp_path=None, **kw):
    return CapsuleStore(FP, device="cpu", disk_dir=tmp_path, **kw)


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_snapshot_dirty_restore_is_bit_identical(tmp_path, tier):
    s = store(tmp_path)
    live = make_state(1)
    before, ptrs = clone(live), {k: v.data_ptr() for k, v in live.items()}
    cid = s.snapshot("before", tier, live, {"decision_id": 7})
    dirty(live, 2)
    assert not torch.equal(bits(live["prefix_k"]), bits(before["prefix_k"]))
    meta = s.restore(cid, live)
    assert_same(live, before)
    assert meta == {"decision_id": 7}
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs  # in place: captured graphs stay valid


def test_restore_twice_is_idempotent_and_meta_is_a_fresh_copy(tmp_path):
    s = store(tmp_path)
    live = make_state(3)
    before = clone(live)
    rng = torch.Generator().manual_seed(5).get_state()
    meta = {"decision_id": 1, "stamps": (10, 20), "rng": rng, "raw": b"\x00\x01", "nested": {"a": [1.5, None]}}
    cid = s.snapshot("x", "host", live, meta)
    dirty(live, 4)
    first = s.restore(cid, live)
    first["nested"]["a"].append("changed by caller")
    dirty(live, 5)
    second = s.restore(cid, live)
    assert_same(live, before)
    assert second["stamps"] == (10, 20) and second["raw"] == b"\x00\x01" and second["nested"] == {"a": [1.5, None]}
    assert torch.equal(second["rng"], rng)


def test_fork_is_independent_of_its_source(tmp_path):
    s = store(tmp_path)
    live = make_state(6)
    before = clone(live)
    for tier in ("device", "disk"):
        src = s.snapshot("src", tier, live, {"decision_id": 3})
        fid = s.fork(src, "branch_b")
        assert fid != src
        s.drop(src)
        dirty(live, 7)
        s.restore(fid, live)
        assert_same(live, before)
        entry = next(e for e in s.list() if e["id"] == fid)
        assert entry["name"] == "branch_b" and entry["tier"] == tier and entry["decision_id"] == 3


def test_list_and_drop(tmp_path):
    s = store(tmp_path)
    live = make_state(8)
    a = s.snapshot("a", "device", live, {"decision_id": 11})
    b = s.snapshot("b", "disk", live, {})
    rows = s.list()
    assert [r["id"] for r in rows] == [a, b]
    assert rows[0]["name"] == "a" and rows[0]["bytes"] == NBYTES and rows[0]["decision_id"] == 11
    assert rows[1]["decision_id"] is None and rows[0]["created"] <= rows[1]["created"]
    disk_dirs = list(tmp_path.iterdir())
    assert len(disk_dirs) == 1
    s.drop(b)
    assert not disk_dirs[0].exists() and [r["id"] for r in s.list()] == [a]
    with pytest.raises(CapsuleError, match=b):
        s.drop(b)


def test_move_through_every_tier_keeps_bytes(tmp_path):
    s = store(tmp_path)
    live = make_state(9)
    before = clone(live)
    cid = s.snapshot("m", "device", live, {"decision_id": 2})
    for tier in ("disk", "host", "disk", "device", "host"):
        s.move(cid, tier)
        assert s.list()[0]["tier"] == tier
        dirty(live, 10)
        assert s.restore(cid, live) == {"decision_id": 2}
        assert_same(live, before)


def test_unknown_id_names_it_and_leaves_live_untouched(tmp_path):
    s = store(tmp_path)
    live = make_state(11)
    s.snapshot("a", "device", live, {})
    dirty(live, 12)
    after_dirty = clone(live)
    with pytest.raises(CapsuleError, match="unknown capsule id 'nope'"):
        s.restore("nope", live)
    assert_same(live, after_dirty)


@pytest.mark.parametrize("bad", ["shape", "dtype", "missing", "extra"])
def test_restore_into_wrong_buffers_validates_before_copying(tmp_path, bad):
    s = store(tmp_path)
    live = make_state(13)
    cid = s.snapshot("a", "host", live, {})
    dirty(live, 14)
    into = dict(live)
    # Break the LAST buffer, so a restore that copied buffer by buffer would already have written the others.
    last = list(LAYOUT)[-1]
    if bad == "shape":
        into[last] = torch.zeros(4, 0)
    elif bad == "dtype":
        into[last] = torch.zeros(0, 4, dtype=torch.float64)
    elif bad == "missing":
        del into[last]
    else:
        into["stranger"] = torch.ones(2)
    snapshot_of_live = clone(live)
    with pytest.raises(CapsuleError, match="stranger" if bad == "extra" else last):
        s.restore(cid, into)
    assert_same(live, snapshot_of_live)


def test_snapshot_refuses_buffers_off_the_fingerprint_layout(tmp_path):
    s = store(tmp_path)
    live = make_state(15)
    live["chunk"] = torch.randn(1, 5, 8)
    with pytest.raises(CapsuleError, match=r"buffer chunk is float32 \(1,5,8\), the fingerprint says float32 \(1,5,7\)"):
        s.snapshot("a", "device", live, {})
    assert s.list() == []


def test_meta_that_cannot_be_stored_is_refused_naming_the_key(tmp_path):
    s = store(tmp_path)
    with pytest.raises(CapsuleError, match=r"meta\.stage\.fn"):
        s.snapshot("a", "device", make_state(16), {"stage": {"fn": object()}})
    with pytest.raises(CapsuleError, match="key 3"):
        s.snapshot("a", "device", make_state(16), {3: "int key"})
    assert s.list() == []


def test_budget_refuse_is_clear_and_changes_nothing(tmp_path):
    s = store(tmp_path, budgets={"device": 2 * NBYTES, "host": None})
    live = make_state(17)
    ids = [s.snapshot(f"s{i}", "device", live, {}) for i in range(2)]
    dirty(live, 18)
    after = clone(live)
    with pytest.raises(CapsuleError, match=r"the device tier is full: its budget of [\d.]+ MB holds 2 capsule\(s\), "
                                           r"[\d.]+ MB \(c0002-\w+, c0001-\w+\), 0.0000 MB free"):
        s.snapshot("third", "device", live, {})
    assert [r["id"] for r in s.list()] == ids and all(r["tier"] == "device" for r in s.list())
    assert_same(live, after)
    s.snapshot("fits on host", "host", live, {})  # other tiers are unaffected
    with pytest.raises(CapsuleError, match="more than the whole device budget"):
        store(tmp_path, budgets={"device": NBYTES - 1}).snapshot("big", "device", live, {})


def test_budget_evict_cascades_oldest_down_and_loses_nothing(tmp_path):
    s = store(tmp_path, budgets={"device": 2 * NBYTES, "host": NBYTES}, on_full="evict")
    states = [make_state(100 + i) for i in range(4)]
    ids = [s.snapshot(f"s{i}", "device", st, {"decision_id": i}) for i, st in enumerate(states)]
    tiers = {r["id"]: r["tier"] for r in s.list()}
    assert [tiers[i] for i in ids] == ["disk", "host", "device", "device"]
    live = make_state(999)
    for cid, st in zip(ids, states):
        assert s.restore(cid, live)["decision_id"] == ids.index(cid)
        assert_same(live, st)


def test_budget_evict_refuses_when_nothing_below_has_room(tmp_path):
    s = CapsuleStore(FP, device="cpu", budgets={"device": NBYTES, "host": NBYTES}, on_full="evict")
    live = make_state(19)
    a = s.snapshot("a", "device", live, {})
    b = s.snapshot("b", "host", live, {})
    with pytest.raises(CapsuleError, match="nothing to evict to below the host tier"):
        s.snapshot("c", "device", live, {})
    assert {r["id"]: r["tier"] for r in s.list()} == {a: "device", b: "host"}  # planned first, nothing moved


def test_time_travel_ring_keeps_the_last_n(tmp_path):
    s = store(tmp_path, ring=3)
    states, ids = [], []
    for decision in range(5):
        states.append(make_state(200 + decision))
        ids.append(s.record(states[-1], {"decision_id": decision}))
    rows = s.list()
    assert [r["decision_id"] for r in rows] == [2, 3, 4] and all(r["ring"] for r in rows)
    live = make_state(300)
    for cid in ids[:2]:
        with pytest.raises(CapsuleError, match="unknown capsule id"):
            s.restore(cid, live)
    for cid, st in zip(ids[2:], states[2:]):
        s.restore(cid, live)
        assert_same(live, st)
    kept = s.fork(ids[2], "keep")  # forking takes a decision out of the ring for good
    for decision in range(5, 8):
        s.record(make_state(400 + decision), {"decision_id": decision})
    s.restore(kept, live)
    assert_same(live, states[2])
    assert s.used("device") == 4 * NBYTES
    assert store(tmp_path).record(live, {}) is None  # ring=0: off


def test_ring_reservation_respects_the_device_budget(tmp_path):
    s = store(tmp_path, ring=3, budgets={"device": 2 * NBYTES})
    with pytest.raises(CapsuleError, match="time-travel ring of 3"):
        s.record(make_state(20), {})


def test_configuration_errors_are_named(tmp_path):
    with pytest.raises(CapsuleError, match="on_full"):
        CapsuleStore(FP, on_full="drop")
    with pytest.raises(CapsuleError, match="unknown tier"):
        CapsuleStore(FP, budgets={"gpu": 1})
    with pytest.raises(CapsuleError, match="needs a disk_dir"):
        CapsuleStore(FP).snapshot("a", "disk", make_state(21), {})
    with pytest.raises(CapsuleError, match="tier must be one of"):
        store(tmp_path).snapshot("a", "vram", make_state(21), {})


def test_fingerprint_digest_and_diff_name_what_differs():
    a = fingerprint("pi05", "w1", torch.bfloat16, {"prefix_k": ((2, 16), "bfloat16"), "x": torch.zeros(3)})
    b = fingerprint("pi05", "w1", "float32", {"prefix_k": ((2, 32), torch.bfloat16), "x": ((3,), "float16"),
                                             "y": ((1,), "int64")})
    same = fingerprint("pi05", "w1", "torch.bfloat16", {"x": ((3,), torch.float32), "prefix_k": ([2, 16], "bfloat16")})
    assert a == same and a.digest() == same.digest() and hash(a) == hash(same) and a.diff(same) == []
    assert a.digest() != b.digest()
    assert a.diff(b) == ["precision: bfloat16 != float32", "buffer prefix_k: shape (2,16) != (2,32)",
                         "buffer x: dtype float32 != float16", "buffer y: absent != present"]
    assert fingerprint("pi0", "w2", "bfloat16", {}).diff(fingerprint("pi05", "w1", "bfloat16", {})) == [
        "model: pi0 != pi05", "weights_digest: w2 != w1"]


def test_odd_live_views_and_swapped_storage_are_restored_exactly(tmp_path):
    s = store(tmp_path)
    backing = {k: torch.zeros((2,) + tuple(s_), dtype=d) for k, (s_, d) in LAYOUT.items()}
    odd = make_state(30)
    # Live buffers that are not one aligned dense block: a transposed view and a view at a 2-byte offset.
    kt = torch.empty(8, 17, 3, 2, dtype=torch.bfloat16).permute(3, 2, 1, 0)
    kt.copy_(odd["prefix_k"])
    flat_v = torch.empty(odd["prefix_v"].numel() + 1, dtype=torch.bfloat16)
    v_off = flat_v[1:].view(odd["prefix_v"].shape)
    v_off.copy_(odd["prefix_v"])
    live = dict(odd, prefix_k=kt, prefix_v=v_off)
    assert not kt.is_contiguous() and v_off.data_ptr() % 8 != 0
    cid = s.snapshot("odd", "device", live, {})
    dirty(live, 31)
    s.restore(cid, live)
    assert_same(live, odd)
    # Same tensor objects, new storage: cached copy views must not write into the old storage.
    live["chunk"].set_(backing["chunk"][1])
    s.restore(cid, live)
    assert torch.equal(bits(backing["chunk"][1]), bits(odd["chunk"]))


@pytest.mark.parametrize("change", ["resize", "retype", "new_object"])
def test_live_tensor_changed_after_a_cached_restore_is_detected(tmp_path, change):
    # The first restores validate once and cache the copy lists; an in-place change of a live tensor's
    # shape or dtype (same object, same address) must still be refused, and a new object still written.
    s = store(tmp_path)
    live = make_state(40)
    want = clone(live)
    cid = s.snapshot("a", "device", live, {})
    for seed in (41, 42):
        dirty(live, seed)
        s.restore(cid, live)
        assert_same(live, want)
    if change == "new_object":
        live["chunk"] = torch.zeros(1, 5, 7)
        s.restore(cid, live)
        assert_same(live, want)
        return
    t = live["counters"]
    ptr = t.data_ptr()
    if change == "resize":
        t.resize_(2)
    else:
        t.data = t.view(torch.float64)  # same bytes, another dtype
    assert t.data_ptr() == ptr
    before = clone(live)
    with pytest.raises(CapsuleError, match="counters"):
        s.restore(cid, live)
    assert_same(live, before)


def test_restore_check_refusal_copies_nothing(tmp_path):
    s = store(tmp_path)
    live = make_state(50)
    cid = s.snapshot("a", "device", live, {"clock": [1, 2]})
    dirty(live, 51)
    before = clone(live)

    def check(meta):
        meta["clock"][5]  # an IndexError is not one of the named kinds: it surfaces as is

    def check_named(meta):
        raise ValueError("clock: wrong length")

    with pytest.raises(CapsuleError, match="meta does not fit this runtime: ValueError: clock: wrong length"):
        s.restore(cid, live, check=check_named)
    assert_same(live, before)
    with pytest.raises(IndexError):
        s.restore(cid, live, check=check)
    assert_same(live, before)
    assert s.restore(cid, live, check=lambda m: None) == {"clock": [1, 2]}


def _names(layout):
    return {k: (s, str(d).removeprefix("torch.")) for k, (s, d) in layout.items()}


def test_arena_buffers_restore_as_one_span_bit_exact(tmp_path):
    """Live buffers allocated with `arena` (as the runtime does) sit like a slab: a restore and a snapshot are
    each one flat copy, and the bytes come back exactly."""
    from flashrt_core.capsule.slab import arena

    flat, live = arena(_names(LAYOUT), "cpu")
    for k, v in make_state(1).items():
        live[k].copy_(v)
    want = clone(live)
    st = store(tmp_path)
    cid = st.snapshot("a", "device", live, {"decision_id": 1})
    dirty(live, 2)
    st.restore(cid, live)
    assert_same(live, want)
    slab = st._caps[cid].slab
    for direction in (True, False):  # to the slab (snapshot) and from it (restore)
        groups, singles, _ = slab.planned[direction][1]
        assert sum(len(d) for d, _ in groups) + len(singles) == 1
    dirty(live, 3)
    st.restore(cid, live)  # the cached span again
    assert_same(live, want)
    assert flat.numel() >= NBYTES


def test_views_of_a_tensor_the_store_does_not_own_never_coalesce(tmp_path):
    """Same offsets as a slab, but inside a user's tensor: the padding between the views may hold the user's
    data, so each buffer is copied on its own and the bytes between them are never written."""
    from flashrt_core.capsule.slab import SlabPlan

    plan = SlabPlan(_names(LAYOUT))
    base = torch.full((plan.total_bytes,), 99, dtype=torch.uint8)
    live = {name: base[o:o + n].view(dt).view(shape) for name, o, n, dt, shape in plan.entries}
    for k, v in make_state(4).items():
        live[k].copy_(v)
    want = clone(live)
    gaps = torch.ones(plan.total_bytes, dtype=torch.bool)
    for _, o, n, _, _ in plan.entries:
        gaps[o:o + n] = False
    assert int(gaps.sum()) > 0
    st = store(tmp_path)
    cid = st.snapshot("a", "device", live, {"decision_id": 1})
    dirty(live, 5)
    st.restore(cid, live)
    assert_same(live, want)
    assert bool((base[gaps] == 99).all())


def test_meta_check_runs_once_per_capsule_and_checker():
    """A capsule's meta is private and never changes: once it passed a runtime's check, restoring it into the
    same runtime again skips the check (host time between two ticks); another checker checks it again, and
    a refused check is never remembered."""
    class Checker:
        def __init__(self, refuse=False):
            self.calls, self.refuse = 0, refuse

        def check(self, meta):
            self.calls += 1
            if self.refuse:
                raise CapsuleError("meta field clocks: names differ")

    s = store()
    live = make_state(60)
    want = clone(live)
    cid = s.snapshot("a", "device", live, {"clocks": {"act": [0, 3]}})
    first, second, bad = Checker(), Checker(), Checker(refuse=True)
    for seed in (61, 62, 63):
        dirty(live, seed)
        s.restore(cid, live, check=first.check)
        assert_same(live, want)
    assert first.calls == 1
    s.restore(cid, live, check=second.check)
    assert second.calls == 1
    for _ in range(2):
        dirty(live, 64)
        before = clone(live)
        with pytest.raises(CapsuleError, match="clocks"):
            s.restore(cid, live, check=bad.check)
        assert_same(live, before)
    assert bad.calls == 2
