"""Live and rewind restores on the tiny pi0.5 Runtime (CPU), and a first snapshot that does no first-time work.

Ticks at 20 ms (act 50 Hz; observe 10 Hz runs at ticks 0, 5, 10, ...), each fed a random observation
stamped at the tick. A rewind restore, fed the same observations on the same clock again, must replay the
snapshotted branch bit for bit; a live restore rewinds the model state but keeps the rate grid and the
stamp watermark: its next tick runs only what the grid has due now, and takes later stamps only.
"""
import numpy as np
import pytest
import torch

import flashrt_core.capsule.runtime_verbs as runtime_verbs
import flashrt_core.capsule.store as store_module
from flashrt_core.contract.runtime import Runtime
from flashrt_core.errors import InputError

# Tolerance table: restores copy bytes and the RNG state, so replayed actions match exactly.
TOLERANCE = {"replayed_actions_max_abs": 0.0}

CONFIG = "config/pi05_tiny.yaml"
MS = 1_000_000
TICK_MS = 20
K = 3  # snapshot after this tick
PROMPT = "put the cup on the plate"


def observation(tick):
    rng = np.random.default_rng(3000 + tick)
    images = [rng.integers(1, 255, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    return images, rng.standard_normal(8).astype(np.float32) + 0.1


def feed(rt, tick):
    images, state = observation(tick)
    rt.set_observation(images=images, state=state, stamp_ns=tick * TICK_MS * MS)


def run_ticks(rt, ticks):
    out = []
    for t in ticks:
        feed(rt, t)
        res = rt.step(t * TICK_MS * MS + MS)
        out.append((tuple(res.ran), res.decision_id, res.prefix_id, res.observation_age_ms,
                    None if res.actions is None else res.actions.copy()))
    return out


def assert_same_run(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:4] == w[:4]
        assert np.array_equal(g[4], w[4]), f"actions differ: max abs {np.abs(g[4] - w[4]).max()}"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_runtime(device="cpu"):
    rt = Runtime.from_config(CONFIG, device=device, seed=0)
    rt.set_prompt(PROMPT)
    return rt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_rewind_replays_the_snapshotted_branch_bit_exactly(tier, device):
    rt = make_runtime(device)
    run_ticks(rt, range(K + 1))
    cid = rt.snapshot("t1", tier=tier)
    branch = run_ticks(rt, range(K + 1, K + 9))  # 8 ticks, observe at ticks 5 and 10 among them
    assert sum("observe" in r[0] for r in branch) == 2
    meta = rt.restore(cid, rewind_time=True)
    assert meta["rewind_time"] is True and meta["decisions"] == K + 1
    assert_same_run(run_ticks(rt, range(K + 1, K + 9)), branch)  # the same observations again: taken
    rt.restore(cid, rewind_time=True)  # and once more, from the same capsule
    assert_same_run(run_ticks(rt, range(K + 1, K + 9)), branch)


def test_a_live_restore_runs_no_burst_and_takes_only_later_stamps():
    rt = make_runtime()
    run_ticks(rt, range(K + 1))
    cid = rt.snapshot("t1", tier="device")
    misses = dict(rt.buffers.ledger.misses)
    branch = run_ticks(rt, range(K + 1, 9))  # on to tick 8: observe ran at tick 5
    clocks = {n: (c.t0, c.n) for n, c in rt.scheduler.clocks.items()}
    meta = rt.restore(cid)  # live (the default)
    assert meta["rewind_time"] is False and rt.decisions == K + 1
    assert {n: (c.t0, c.n) for n, c in rt.scheduler.clocks.items()} == clocks  # the grid goes on from now
    with pytest.raises(InputError, match="older than the last observation"):
        feed(rt, K + 1)  # the watermark goes on too: the robot's stamps only move forward
    (ran, decision, prefix, age, actions), = run_ticks(rt, [9])
    # Tick 9 has only act due (observe is due at tick 10): no burst of every stage, no missed points counted.
    assert ran == ("act",) and decision == K + 2 and rt.buffers.ledger.misses == misses
    # The model state rewound: act used the snapshot's prefix (observed at tick 0) and noise RNG, as the
    # branch's first tick did.
    assert branch[0][0] == ("act",) and prefix == branch[0][2] and age == 9 * TICK_MS + 1
    assert np.array_equal(actions, branch[0][4])
    (ran, *_), = run_ticks(rt, [10])  # the fresh observations reach the prefix at the next observe point
    assert ran == ("observe", "act")

    # A rewind restore at the same moment returns the clocks to the snapshot's: every stage due at once.
    rewound = make_runtime()
    run_ticks(rewound, range(K + 1))
    cid = rewound.snapshot("t1", tier="device")
    run_ticks(rewound, range(K + 1, 9))
    rewound.restore(cid, rewind_time=True)
    (ran, *_), = run_ticks(rewound, [9])
    assert ran == ("observe", "act") and rewound.buffers.ledger.misses["act"] > misses["act"]


@pytest.mark.parametrize("device", DEVICES)
def test_the_first_snapshot_after_warmup_does_no_first_time_work(monkeypatch, device):
    rt = make_runtime(device)
    rt.warmup()
    store = rt.capsules
    assert store is not None and store.slabs_allocated == 2  # one spare per memory tier, made at warmup
    if device == "cuda":  # the device spare in GPU memory, the host one pinned (its first allocation is slow)
        assert store._spare["device"].flat.is_cuda and store._spare["host"].flat.is_pinned()
    assert store.used("device") == 0 and store.used("host") == 0  # spares are not capsules
    run_ticks(rt, range(K + 1))
    want = {k: v.clone() for k, v in rt.persistent_buffers().items()}

    made = []
    real_slab = store_module.Slab
    monkeypatch.setattr(store_module, "Slab", lambda *a, **k: made.append(a) or real_slab(*a, **k))

    def no_digest():
        raise AssertionError("the weights were hashed on the control path")

    monkeypatch.setattr(rt.binding, "weights", no_digest)
    monkeypatch.setattr(runtime_verbs, "runtime_fingerprint", lambda rt: no_digest())

    on_device = rt.snapshot("first", tier="device")
    on_host = rt.snapshot("first on host", tier="host")
    assert made == [] and store.slabs_allocated == 2  # both came from the spares
    for cid in (on_device, on_host):
        slab = store._caps[cid].slab
        assert set(slab.planned) == {True, False}  # the restore's copy lists were planned at warmup
    run_ticks(rt, range(K + 1, K + 3))
    for cid in (on_device, on_host):
        rt.restore(cid, rewind_time=True)
        assert all(torch.equal(v, want[k]) for k, v in rt.persistent_buffers().items())
    rt.drop_capsule(on_device)  # a dropped capsule's slab is the next snapshot's
    rt.snapshot("again", tier="device")
    assert made == [] and store.slabs_allocated == 2
    rt.fork(on_host, "branch")  # a fork needs a slab of its own (per-call work, not first-time work)
    assert len(made) == 1

    # Without warmup the first snapshot does all of it: digest, store, slab.
    monkeypatch.undo()
    cold = make_runtime(device)
    run_ticks(cold, range(2))
    assert cold.capsules is None
    cold.snapshot("cold", tier="device")
    assert cold.capsules.slabs_allocated == 1 and cold._weights_digest is not None
