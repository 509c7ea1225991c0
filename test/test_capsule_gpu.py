"""Capsules on CUDA: device and pinned-host tiers, side-stream ordering, CUDA graphs surviving a restore."""
import pytest
import torch

from flashrt_core.capsule import CapsuleStore, fingerprint
from flashrt_core.errors import CapsuleError

pytestmark = pytest.mark.gpu

# Tolerance table: bytes are copied, never computed, so comparisons are bitwise (0 ULP).
TOLERANCE_ULP = {"restore": 0, "graph_replay_after_restore": 0}

LAYOUT = {
    "prefix_k": ((3, 1, 1, 37, 64), torch.bfloat16),
    "prefix_v": ((3, 1, 1, 37, 64), torch.bfloat16),
    "prev_chunk": ((1, 9, 7), torch.float32),
    "counters": ((5,), torch.int64),
}
FP = fingerprint("pi05-tiny", "w", "bfloat16", LAYOUT)
NBYTES = sum(torch.empty(s, dtype=d).numel() * d.itemsize for s, d in LAYOUT.values())


def make_state(seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in LAYOUT.items():
        t = torch.randn(shape, generator=g) + 0.5 if dtype.is_floating_point else torch.randint(1, 99, shape, generator=g)
        out[name] = t.to(dtype).to(device)
    return out


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b):
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), f"buffer {k} differs"


def overwrite(live, seed):
    for k, v in make_state(seed).items():
        live[k].copy_(v)


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_cuda_snapshot_dirty_restore(tmp_path, tier):
    s = CapsuleStore(FP, device="cuda", disk_dir=tmp_path)
    live = make_state(1)
    before = {k: v.clone() for k, v in live.items()}
    cid = s.snapshot("a", tier, live, {"decision_id": 1})
    overwrite(live, 2)
    s.restore(cid, live)
    s.restore(cid, live)
    assert_same(live, before)
    if tier == "device":
        assert s._caps[cid].slab.flat.is_cuda
    if tier == "host":
        assert s._caps[cid].slab.flat.is_pinned()


def test_side_stream_snapshot_sees_queued_writes_and_not_later_ones():
    s = CapsuleStore(FP, device="cuda")
    live = make_state(3)
    want = make_state(4)
    big = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # keep the caller's stream busy so the write below is still queued at snapshot time
        big = big @ big.T / 4096
    for k in live:
        live[k].copy_(want[k])
    cid = s.snapshot("a", "device", live, {})  # returns without waiting for the queued work
    overwrite(live, 5)  # queued after the snapshot: must not leak into it
    s.restore(cid, live)
    assert_same(live, want)


def test_cuda_graph_over_live_buffers_stays_valid_after_restore():
    s = CapsuleStore(FP, device="cuda")
    live = make_state(6)
    before = {k: v.clone() for k, v in live.items()}
    out = torch.empty_like(live["prefix_k"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(live["prefix_k"] * 2 + live["prefix_v"])  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(live["prefix_k"] * 2 + live["prefix_v"])
    cid = s.snapshot("a", "host", live, {})
    overwrite(live, 7)
    s.restore(cid, live)
    graph.replay()
    torch.cuda.synchronize()
    ref = before["prefix_k"] * 2 + before["prefix_v"]
    assert torch.equal(bits(out), bits(ref))


def test_cuda_evict_cascade_keeps_every_capsule(tmp_path):
    s = CapsuleStore(FP, device="cuda", budgets={"device": NBYTES, "host": NBYTES}, on_full="evict",
                     disk_dir=tmp_path)
    states = [make_state(10 + i) for i in range(3)]
    ids = [s.snapshot(str(i), "device", st, {}) for i, st in enumerate(states)]
    assert [r["tier"] for r in s.list()] == ["disk", "host", "device"]
    live = make_state(99)
    for cid, st in zip(ids, states):
        s.restore(cid, live)
        assert_same(live, st)
    with pytest.raises(CapsuleError, match="unknown capsule id"):
        s.restore("c9999", live)


def test_cuda_export_import_and_ring(tmp_path):
    s = CapsuleStore(FP, device="cuda", ring=2)
    states = [make_state(20 + i) for i in range(3)]
    ids = [s.record(st, {"decision_id": i}) for i, st in enumerate(states)]
    s.export(ids[-1], tmp_path / "x")
    other = CapsuleStore(FP, device="cuda")
    cid = other.import_(tmp_path / "x", "device")
    live = make_state(30)
    other.restore(cid, live)
    assert_same(live, states[-1])
    s.restore(ids[1], live)
    assert_same(live, states[1])


def test_host_placed_buffers_restore_from_the_host_mirror_on_every_path(tmp_path):
    """A CUDA runtime's `place: host` buffers (the prompt state) live on the host: a device-tier restore writes
    them from the slab's host mirror (no device-to-host copy behind queued GPU work); a slab filled without a
    mirror (moved in from the host or disk tier, imported) restores them from the slab itself."""
    live = make_state(1)
    live["counters"] = live["counters"].cpu()  # the host-placed buffer
    s = CapsuleStore(FP, device="cuda", disk_dir=tmp_path)
    before = {k: v.clone() for k, v in live.items()}
    cid = s.snapshot("a", "device", live, {})
    assert set(s._caps[cid].slab.mirror) == {list(sorted(LAYOUT)).index("counters")}
    live["counters"].add_(7)  # the host state moves on after the snapshot: the mirror kept the old one
    fork = s.fork(cid, "b")
    for capsule in (cid, fork):
        overwrite_gpu = make_state(3)
        for k in ("prefix_k", "prefix_v", "prev_chunk"):
            live[k].copy_(overwrite_gpu[k])
        live["counters"].fill_(-1)
        s.restore(capsule, live)
        torch.cuda.synchronize()
        assert_same(live, before)
    for route in ("host", "disk"):  # device -> other tier -> device: no mirror any more
        s.move(fork, route)
        s.move(fork, "device")
        assert s._caps[fork].slab.mirror == {}
        live["counters"].fill_(-1)
        s.restore(fork, live)
        torch.cuda.synchronize()
        assert_same(live, before)
