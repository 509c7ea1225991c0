"""The Runtime against a toy model binding defined here: proves the runtime is model-agnostic and checks its
bookkeeping (versions, stamps, ages, late observations, limits, input validation) with a model small enough
to recompute by hand in plain torch."""
import copy
import pathlib

import numpy as np
import pytest
import torch

from flashrt_core.contract.runtime import Runtime
from flashrt_core.contract.spec import StageSignature, load_contract, validate
from flashrt_core.contract.bindings import ModelBinding
from flashrt_core.errors import InputError

# tolerance table: the toy's device part is recomputed with the same ops in the same order
TOL = {"actions_vs_reference": 0.0}

MS = 1_000_000
TOY_DIMS = {"views": 2, "height": 6, "width": 5, "state_dim": 3, "feat": 4, "chunk": 5, "action_dim": 2,
            "prompt_bytes": 32}
FLOW_STEPS = 3


def toy_weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(1000 + seed)
    d = TOY_DIMS
    obs_in = d["views"] * 3 + d["state_dim"]
    return {"w_obs": torch.randn(d["feat"], obs_in, generator=g) * 0.5,
            "w_task": torch.randn(d["feat"], 8, generator=g) * 0.5,
            "a": torch.randn(d["action_dim"], d["action_dim"], generator=g) * 0.5,
            "b": torch.randn(d["feat"], d["action_dim"], generator=g) * 0.5}


def toy_task(prompt_bytes: torch.Tensor, w_task: torch.Tensor) -> torch.Tensor:
    """Prompt -> task vector: byte histogram over 8 buckets, projected (deterministic, prompt-sensitive)."""
    hist = torch.zeros(8)
    data = prompt_bytes[prompt_bytes != 0].long()
    hist.index_add_(0, data % 8, torch.ones(len(data)))
    return torch.tanh(w_task @ (hist / max(len(data), 1)))


def toy_observe(images, mask, state, task, w_obs):
    pix = images.float().mean(dim=(1, 2)) / 255.0 * mask.float()[:, None]  # [views, 3]
    return torch.tanh(w_obs @ torch.cat([pix.reshape(-1), state]) + task)


def toy_act(prefix, noise, a, b):
    x = noise
    for _ in range(FLOW_STEPS):
        x = x + 0.1 * torch.tanh(x @ a + prefix @ b)
    return x


class ToyBinding(ModelBinding):
    name = "toy"

    @classmethod
    def dims(cls, model):
        return dict(TOY_DIMS, **{k: v for k, v in model.options.items() if k in TOY_DIMS})

    @classmethod
    def signatures(cls, dims, model):
        d = dims
        img = ((d["views"], d["height"], d["width"], 3), "uint8")
        return {
            "prompt": StageSignature(reads={"prompt": ((d["prompt_bytes"],), "uint8")},
                                     writes={"task": ((d["feat"],), "float32")}),
            "observe": StageSignature(
                reads={"task": ((d["feat"],), "float32"), "images": img, "image_mask": ((d["views"],), "bool"),
                       "state": ((d["state_dim"],), "float32")},
                writes={"prefix": ((d["feat"],), "float32")}),
            "act": StageSignature(reads={"prefix": ((d["feat"],), "float32")},
                                  writes={"noise": ((d["chunk"], d["action_dim"]), "float32"),
                                          "actions": ((d["chunk"], d["action_dim"]), "float32")}),
            "energy": StageSignature(reads={"actions": ((d["chunk"], d["action_dim"]), "float32")},
                                     writes={"action_energy": ((1,), "float32")}),
        }

    def __init__(self, model, dims, device, dtype, seed, tokenizer=None):
        super().__init__(model, dims, device, dtype, seed, tokenizer)
        self.w = {k: v.to(device) for k, v in toy_weights(seed).items()}
        self.w_task_cpu = toy_weights(seed)["w_task"]

    def host(self, stage, io):
        if stage == "prompt":
            io.to_device("task", toy_task(io.host("prompt"), self.w_task_cpu))
        elif stage == "act":
            d = self.dims
            io.to_device("noise", torch.randn(d["chunk"], d["action_dim"], generator=io.generator))

    def device_part(self, stage):
        w = self.w

        def observe(b):
            b["prefix"].copy_(toy_observe(b["images"], b["image_mask"], b["state"], b["task"], w["w_obs"]))

        def act(b):
            b["actions"].copy_(toy_act(b["prefix"], b["noise"], w["a"], w["b"]))

        def energy(b):
            b["action_energy"].copy_((b["actions"] ** 2).sum().reshape(1))

        return {"observe": observe, "act": act, "energy": energy}.get(stage)

    def weights(self):
        return list(self.w.items())


def toy_contract(observe_hz=10, act_hz=50, late="reuse", max_age=None, graphs="stage", deferred=False):
    return {
        "model": {"name": "test_runtime_toy:ToyBinding"},
        "limits": {"max_observation_age_ms": max_age, "late_observe": late},
        "output": "actions",
        "graphs": graphs,
        "buffers": {
            "prompt": {"shape": ["prompt_bytes"], "dtype": "uint8", "lifetime": "input", "place": "host"},
            "images": {"shape": ["views", "height", "width", 3], "dtype": "uint8", "lifetime": "input"},
            "image_mask": {"shape": ["views"], "dtype": "bool", "lifetime": "input"},
            "state": {"shape": ["state_dim"], "dtype": "float32", "lifetime": "input"},
            "task": {"shape": ["feat"], "dtype": "float32", "lifetime": "persistent"},
            "prefix": {"shape": ["feat"], "dtype": "float32", "lifetime": "persistent"},
            "noise": {"shape": ["chunk", "action_dim"], "dtype": "float32", "lifetime": "transient"},
            "actions": {"shape": ["chunk", "action_dim"], "dtype": "float32", "lifetime": "persistent"},
            "action_energy": {"shape": [1], "dtype": "float32", "lifetime": "transient"},
        },
        "stages": {
            "prompt": {"reads": ["prompt"], "writes": ["task"], "trigger": {"on_change": "prompt"}},
            "observe": {"reads": ["task", "images", "image_mask", "state"], "writes": ["prefix"],
                        "trigger": {"rate_hz": observe_hz, "on_change": "task"}, "deferred": deferred},
            "act": {"reads": ["prefix"], "writes": ["noise", "actions"], "trigger": {"rate_hz": act_hz}},
            "energy": {"reads": ["actions"], "writes": ["action_energy"], "trigger": {"after": "act"}},
        },
    }


def make_runtime(seed=0, **kw):
    contract = validate(toy_contract(**kw), binding=ToyBinding)
    return Runtime(contract, ToyBinding, device="cpu", seed=seed)


def observation(rng, views=2, missing=()):
    images = [None if i in missing else rng.integers(0, 256, (6, 5, 3), dtype=np.uint8) for i in range(views)]
    return images, rng.standard_normal(3).astype(np.float32)


def reference_actions(images, state, prompt, noise, seed=0):
    w = toy_weights(seed)
    enc = np.zeros(32, np.uint8)
    enc[:len(prompt.encode())] = np.frombuffer(prompt.encode(), np.uint8)
    task = toy_task(torch.from_numpy(enc), w["w_task"])
    frames = torch.from_numpy(np.stack([np.zeros((6, 5, 3), np.uint8) if i is None else i for i in images]))
    mask = torch.tensor([i is not None for i in images])
    prefix = toy_observe(frames, mask, torch.from_numpy(state), task, w["w_obs"])
    return toy_act(prefix, noise, w["a"], w["b"]).numpy()


def test_decisions_match_reference_and_ages():
    rt = make_runtime()
    assert rt.describe().endswith("graphs none (CPU)")  # (the contract's graphs mode applies on CUDA only)
    rng = np.random.default_rng(1)
    rt.set_prompt("pick up the red cube")
    imgs, state = observation(rng)
    rt.set_observation(images=imgs, state=state, stamp_ns=0)
    noise_gen = torch.Generator().manual_seed(0)
    r0 = rt.step(0)
    assert r0.ran == ["prompt", "observe", "act", "energy"]
    assert r0.decision_id == 1 and r0.observation_age_ms == 0.0 and r0.reason is None
    ref = reference_actions(imgs, state, "pick up the red cube", torch.randn(5, 2, generator=noise_gen))
    np.testing.assert_allclose(r0.actions, ref, atol=TOL["actions_vs_reference"], rtol=0)
    # act-only ticks reuse the prefix: exactly a whole decision on that observation with the next noise
    for k in range(1, 5):
        r = rt.step(k * 20 * MS)
        assert r.ran == ["act", "energy"] and r.decision_id == k + 1
        assert r.observation_age_ms == pytest.approx(20.0 * k)
        ref = reference_actions(imgs, state, "pick up the red cube", torch.randn(5, 2, generator=noise_gen))
        np.testing.assert_allclose(r.actions, ref, atol=TOL["actions_vs_reference"], rtol=0)
    # a fresh observation stamped 95 ms, seen at the 100 ms tick: age 5 ms
    imgs2, state2 = observation(rng)
    rt.set_observation(images=imgs2, state=state2, stamp_ns=95 * MS)
    r = rt.step(100 * MS)
    assert r.ran == ["observe", "act", "energy"] and r.observation_age_ms == pytest.approx(5.0)
    ref = reference_actions(imgs2, state2, "pick up the red cube", torch.randn(5, 2, generator=noise_gen))
    np.testing.assert_allclose(r.actions, ref, atol=TOL["actions_vs_reference"], rtol=0)
    led = rt.buffers.ledger.buffers
    assert led["prefix"].version == 2 and led["prefix"].stamp_ns == 95 * MS and led["prefix"].step == 5
    assert led["actions"].version == 6


def test_a_decision_held_for_an_input_never_set_names_that_input():
    """No prompt ever set: act waits for the prefix, and the reason traces that back to the prompt input."""
    rt = make_runtime()
    imgs, state = observation(np.random.default_rng(4))
    rt.set_observation(images=imgs, state=state, stamp_ns=0)
    r = rt.step(0)
    assert r.actions is None and "the input prompt was never set" in r.reason, r.reason
    rt.set_prompt("pick up the red cube")
    assert rt.step(20 * MS).actions is not None


def test_new_prompt_reencodes_at_next_tick_and_same_prompt_does_not():
    rt = make_runtime()
    rng = np.random.default_rng(2)
    rt.set_prompt("stack the blocks")
    imgs, state = observation(rng)
    rt.set_observation(images=imgs, state=state, stamp_ns=0)
    rt.step(0)
    rt.set_prompt("stack the blocks")  # unchanged: not a change
    assert rt.step(20 * MS).ran == ["act", "energy"]
    rt.set_prompt("open the drawer")
    r = rt.step(40 * MS)  # observe is not due by rate (10 Hz) but the task changed
    assert r.ran == ["prompt", "observe", "act", "energy"]
    assert r.observation_age_ms == pytest.approx(40.0)  # same observation, new prompt
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        noise = torch.randn(5, 2, generator=gen)
    np.testing.assert_allclose(r.actions, reference_actions(imgs, state, "open the drawer", noise), atol=0)
    assert rt.step(60 * MS).ran == ["act", "energy"]


def test_late_observation_reuse_then_age_limit():
    rt = make_runtime(max_age=150)
    rng = np.random.default_rng(3)
    rt.set_prompt("wipe the table")
    rt.set_observation(*observation(rng), stamp_ns=0)
    rt.step(0)
    r = rt.step(100 * MS)  # observe due, but no new observation: reuse the prefix
    assert r.ran == ["act", "energy"] and "late" in r.skipped["observe"]
    assert r.observation_age_ms == pytest.approx(100.0) and r.actions is not None
    r = rt.step(160 * MS)
    assert r.actions is None and r.ran == [] and r.decision_id is None
    assert "160.0 ms exceeds limits.max_observation_age_ms = 150 (the oldest it reads: " in r.reason
    assert r.observation_age_ms == pytest.approx(160.0)
    rt.set_observation(*observation(rng), stamp_ns=170 * MS)
    r = rt.step(200 * MS)
    assert r.ran == ["observe", "act", "energy"] and r.observation_age_ms == pytest.approx(30.0)
    assert rt.buffers.ledger.lates["observe"] == 1


def test_an_observation_stamped_in_the_future_gives_no_actions():
    """A negative age passes any age limit, so an observation stamped further ahead of the runtime's clock
    than the limit (a sensor clock that disagrees with ours) is refused like a stale one; within the limit
    (ordinary skew) it is used."""
    rt = make_runtime(max_age=150)
    rng = np.random.default_rng(5)
    rt.set_prompt("stack the cups")
    rt.set_observation(*observation(rng), stamp_ns=1000 * MS)
    r = rt.step(800 * MS)
    assert r.actions is None and r.decision_id is None
    assert "observation stamped 200.0 ms in the future (more than limits.max_observation_age_ms = 150)" in r.reason
    r = rt.step(900 * MS)  # 100 ms ahead: within the limit
    assert r.actions is not None and r.observation_age_ms == pytest.approx(-100.0)


@pytest.mark.parametrize("deferred", [False, True], ids=["inline", "deferred"])
def test_late_observation_wait_holds_act_until_fresh_inputs(deferred):
    """Also with observe deferred: the observe that waited runs before act once fresh frames come (deferring
    it would hand act the very prefix it was held back from)."""
    rt = make_runtime(late="wait", deferred=deferred)
    rng = np.random.default_rng(4)
    rt.set_prompt("fold the towel")
    rt.set_observation(*observation(rng), stamp_ns=0)
    assert rt.step(0).ran == ["prompt", "observe", "act", "energy"]
    assert rt.step(20 * MS).ran == ["act", "energy"]
    r = rt.step(100 * MS)
    assert r.actions is None and r.reason == "waiting for observe (late_observe: wait)"
    r = rt.step(120 * MS)
    assert r.actions is None and "waiting for observe" in r.reason
    rt.set_observation(*observation(rng), stamp_ns=125 * MS)
    r = rt.step(140 * MS)  # observe was pending since 100 ms: it runs now, act with it
    assert r.deferred == [] and r.prefix_id == 2
    assert r.ran == ["observe", "act", "energy"] and r.observation_age_ms == pytest.approx(15.0)
    assert rt.step(160 * MS).ran == ["act", "energy"]
    r = rt.step(200 * MS)  # observe due again with nothing new: waits again, so act is held
    assert r.ran == [] and r.skipped["observe"].startswith("late") and r.observation_age_ms == pytest.approx(75.0)
    assert rt.buffers.ledger.misses["observe"] == 0 and rt.buffers.ledger.runs["observe"] == 2


@pytest.mark.parametrize("graphs", ["stage", "plan"])
def test_deferred_observe_runs_after_act_and_counts_from_the_next_tick(graphs):
    """observe deferred: at an observe tick act uses the previous prefix (and reports its age), observe runs
    after it, and the next tick's act uses the new prefix: exactly the reference on each observation."""
    rt = make_runtime(deferred=True, graphs=graphs)
    rng = np.random.default_rng(5)
    noise_gen = torch.Generator().manual_seed(0)
    rt.set_prompt("pour the water")
    imgs, state = observation(rng)
    rt.set_observation(images=imgs, state=state, stamp_ns=0)
    r = rt.step(0)  # the prefix was never produced: observe runs in order, so the first tick decides
    assert r.ran == ["prompt", "observe", "act", "energy"] and r.deferred == [] and r.decision_id == 1
    np.testing.assert_allclose(r.actions, reference_actions(imgs, state, "pour the water",
                                                            torch.randn(5, 2, generator=noise_gen)), atol=0)
    assert rt.step(20 * MS).ran == ["act", "energy"]
    torch.randn(5, 2, generator=noise_gen)
    imgs2, state2 = observation(rng)
    rt.set_observation(images=imgs2, state=state2, stamp_ns=95 * MS)
    r = rt.step(100 * MS)
    assert r.ran == ["act", "energy", "observe"] and r.deferred == ["observe"]
    assert r.observation_age_ms == pytest.approx(100.0) and r.observation_stamp_ns == 0
    np.testing.assert_allclose(r.actions, reference_actions(imgs, state, "pour the water",
                                                            torch.randn(5, 2, generator=noise_gen)), atol=0)
    assert r.prefix_id == 1  # the prefix these actions came from (the deferred refresh will be 2)
    assert rt.buffers.ledger.buffers["prefix"].version == 2  # the ledger counts the queued refresh
    assert set(r.deferred_latency_ms) == {"observe"} and r.deferred_latency_ms["observe"] > 0  # CPU: now
    done = r.completed_stage_ms()  # for statistics: the deferred stage's device time, not its host part
    assert done["observe"] == r.deferred_latency_ms["observe"] and {"act", "energy"} <= set(done)
    r = rt.step(120 * MS)
    assert r.ran == ["act", "energy"] and r.observation_age_ms == pytest.approx(25.0)
    np.testing.assert_allclose(r.actions, reference_actions(imgs2, state2, "pour the water",
                                                            torch.randn(5, 2, generator=noise_gen)), atol=0)
    led = rt.buffers.ledger
    assert led.buffers["prefix"].stamp_ns == 95 * MS and led.seen["act"]["prefix"] == 2
    # a new prompt: the prompt stage runs in order, observe re-encodes deferred, act keeps the old prefix once
    rt.set_prompt("wipe the spill")
    r = rt.step(140 * MS)
    assert r.ran == ["prompt", "act", "energy", "observe"]
    np.testing.assert_allclose(r.actions, reference_actions(imgs2, state2, "pour the water",
                                                            torch.randn(5, 2, generator=noise_gen)), atol=0)
    r = rt.step(160 * MS)
    np.testing.assert_allclose(r.actions, reference_actions(imgs2, state2, "wipe the spill",
                                                            torch.randn(5, 2, generator=noise_gen)), atol=0)
    led = rt.buffers.ledger
    assert led.misses["observe"] == 0 and led.runs["observe"] == 3 and led.buffers["prefix"].version == 3


def test_deferred_override_and_summary():
    contract = validate(toy_contract(), binding=ToyBinding).with_overrides(deferred={"observe": True},
                                                                          binding=ToyBinding)
    assert contract.stages["observe"].deferred and not contract.stages["act"].deferred
    assert "observe: 10 Hz + on change of task (deferred)" in contract.summary()
    pi05 = pathlib.Path(__file__).resolve().parents[1] / "config" / "pi05_tiny.yaml"
    assert not load_contract(pi05).stages["observe"].deferred
    rt = Runtime.from_config(pi05, deferred={"observe": True})
    assert rt.contract.stages["observe"].deferred
    assert rt.warmup_s is None
    rt.warmup()
    assert rt.warmup_s > 0  # the node logs it: a first start on a GPU tunes kernels for minutes


def test_deferred_observe_runs_in_order_rather_than_cost_a_decision_for_age():
    """With a fresh frame after an outage, deferring observe would leave act with a prefix past the age
    limit: the refresh runs in order and act decides on it, as without deferral."""
    rt = make_runtime(max_age=150, deferred=True)
    rng = np.random.default_rng(3)
    rt.set_prompt("wipe the table")
    rt.set_observation(*observation(rng), stamp_ns=0)
    rt.step(0)
    assert rt.step(100 * MS).actions is not None  # late observe: reuse (age 100 ms)
    r = rt.step(160 * MS)
    assert r.actions is None and "exceeds limits.max_observation_age_ms = 150" in r.reason
    rt.set_observation(*observation(rng), stamp_ns=195 * MS)
    r = rt.step(200 * MS)
    assert r.ran == ["observe", "act", "energy"] and r.deferred == [] and r.observation_age_ms == pytest.approx(5.0)


class PostBinding(ToyBinding):
    """The toy plus a stage `post` (prefix + state -> post_out) to hang `after` the deferred observe."""

    @classmethod
    def signatures(cls, dims, model):
        sig = dict(super().signatures(dims, model))
        sig["post"] = StageSignature(reads={"prefix": ((dims["feat"],), "float32"),
                                            "state": ((dims["state_dim"],), "float32")},
                                     writes={"post_out": ((dims["feat"],), "float32")})
        return sig

    def device_part(self, stage):
        if stage == "post":
            return lambda b: b["post_out"].copy_(b["prefix"] * 2.0 + b["state"].sum())
        return super().device_part(stage)


def test_after_child_of_a_deferred_stage_runs_behind_it_on_its_new_outputs():
    raw = toy_contract(deferred=True)
    raw["buffers"]["post_out"] = {"shape": ["feat"], "dtype": "float32", "lifetime": "persistent"}
    raw["stages"]["post"] = {"reads": ["prefix", "state"], "writes": ["post_out"], "trigger": {"after": "observe"}}
    rt = Runtime(validate(raw, binding=PostBinding), PostBinding, device="cpu", seed=0)
    rng = np.random.default_rng(7)
    rt.set_prompt("pick")
    rt.set_observation(*observation(rng), stamp_ns=0)
    rt.step(0)
    rt.set_prompt("place")  # observe re-encodes (deferred); post follows it although no input changed
    r = rt.step(20 * MS)
    assert r.ran == ["prompt", "act", "energy", "observe", "post"] and r.deferred == ["observe", "post"]
    rt.set_observation(*observation(rng), stamp_ns=90 * MS)
    r = rt.step(100 * MS)
    assert r.ran == ["act", "energy", "observe", "post"]
    led = rt.buffers.ledger.buffers
    assert led["post_out"].stamp_ns == led["prefix"].stamp_ns == 90 * MS
    b = rt.buffers.tensors
    torch.testing.assert_close(b["post_out"], b["prefix"] * 2.0 + b["state"].sum(), rtol=0, atol=0)


class FlakyObserveBinding(ToyBinding):
    """The toy whose observe host part fails while `fail` is set (e.g. a prompt the tokenizer refuses)."""

    fail = False

    def host(self, stage, io):
        if stage == "observe" and self.fail:
            raise ValueError("tokenizer refused the prompt")
        super().host(stage, io)


def test_a_failing_deferred_host_part_leaves_the_ledger_true_and_the_actions_out():
    raw = toy_contract(deferred=True)
    rt = Runtime(validate(raw, binding=FlakyObserveBinding), FlakyObserveBinding, device="cpu", seed=0)
    rng = np.random.default_rng(8)
    rt.set_prompt("stack")
    rt.set_observation(*observation(rng), stamp_ns=0)
    rt.step(0)
    rt.set_observation(*observation(rng), stamp_ns=95 * MS)
    rt.binding.fail = True
    r = rt.step(100 * MS)
    assert r.actions is not None and r.ran == ["act", "energy"] and r.deferred == []
    assert r.skipped["observe"] == "failed in its host part: ValueError: tokenizer refused the prompt"
    led = rt.buffers.ledger
    assert led.buffers["prefix"].version == 1 and led.runs["observe"] == 1 and r.prefix_id == 1
    rt.binding.fail = False
    r = rt.step(120 * MS)  # still due (its grid point was not used up): it runs now, deferred
    assert r.ran == ["act", "energy", "observe"] and r.observation_age_ms == pytest.approx(120.0)
    assert led.buffers["prefix"].version == 2 and led.buffers["prefix"].stamp_ns == 95 * MS
    assert led.misses["observe"] == 0


def test_on_actions_hands_the_actions_over_before_the_deferred_work():
    rt = make_runtime(deferred=True)
    rng = np.random.default_rng(9)
    rt.set_prompt("push")
    rt.set_observation(*observation(rng), stamp_ns=0)
    rt.step(0)
    rt.set_observation(*observation(rng), stamp_ns=95 * MS)
    seen = []

    def on_actions(res):  # the deferred observe is neither committed nor launched yet
        seen.append((res.decision_id, res.prefix_id, rt.buffers.ledger.buffers["prefix"].version,
                     rt.buffers.ledger.runs["observe"], res.actions.copy(), res.latency_ms))

    r = rt.step(100 * MS, on_actions=on_actions)
    assert len(seen) == 1
    decision, prefix, version, observes, actions, latency = seen[0]
    assert decision == r.decision_id == 2 and prefix == r.prefix_id == 1 and (version, observes) == (1, 1)
    np.testing.assert_array_equal(actions, r.actions)
    assert latency == r.actions_ms <= r.latency_ms
    assert rt.buffers.ledger.buffers["prefix"].version == 2 and r.ran == ["act", "energy", "observe"]
    assert rt.step(110 * MS, on_actions=on_actions).actions is None and len(seen) == 1  # no actions: no call

    def broken(res):
        raise RuntimeError("publisher gone")

    rt.set_observation(*observation(rng), stamp_ns=195 * MS)
    with pytest.raises(RuntimeError, match="publisher gone"):
        rt.step(200 * MS, on_actions=broken)
    led = rt.buffers.ledger  # the step finished its work before raising: observe committed and launched
    assert led.runs["observe"] == 3 and led.buffers["prefix"].stamp_ns == 195 * MS and led.decisions == 3


def test_on_actions_may_not_step_feed_or_rewind_the_runtime():
    rt = make_runtime()
    rng = np.random.default_rng(10)
    rt.set_prompt("sort")
    rt.set_observation(*observation(rng), stamp_ns=0)
    calls = {"step": lambda: rt.step(40 * MS), "set_prompt": lambda: rt.set_prompt("other"),
             "set_observation": lambda: rt.set_observation(*observation(rng), stamp_ns=30 * MS),
             "snapshot": lambda: rt.snapshot("inside"), "restore": lambda: rt.restore("c-none")}
    t = 0
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"Runtime.{name} cannot be called from inside an on_actions"):
            rt.step(t * MS, on_actions=lambda res, call=call: call())
        t += 20
    led = rt.buffers.ledger  # every step finished its work and counted its decision once
    assert led.decisions == len(calls) and led.runs["act"] == len(calls)
    assert rt.prompt == "sort" and rt.list_capsules() == []


def test_reset_clock_after_the_clock_jumped_back():
    """A simulation reset sends the clock back: without reset_clock every rate stage waits for the old grid
    and every new observation is older than the last one. After it, the stages are due at the next step
    again, the new observation is taken, and nothing stamped on the old clock is acted on."""
    rt = make_runtime(max_age=150)
    rng = np.random.default_rng(6)
    rt.set_prompt("open the door")
    rt.set_observation(*observation(rng), stamp_ns=5000 * MS)
    assert rt.step(5000 * MS).actions is not None
    assert rt.step(5020 * MS).ran == ["act", "energy"]
    with pytest.raises(InputError, match="older than the last observation"):
        rt.set_observation(*observation(rng), stamp_ns=10 * MS)
    assert rt.step(20 * MS).ran == []  # the old grid: nothing due for ~5 s
    rt.reset_clock()
    rt.set_observation(*observation(rng), stamp_ns=40 * MS)
    r = rt.step(50 * MS)  # every rate stage is due at the first step on the new clock
    assert r.ran == ["observe", "act", "energy"] and r.observation_age_ms == pytest.approx(10.0)
    assert rt.step(70 * MS).ran == ["act", "energy"]  # and the new grid goes on from there
    # a step on the new clock before any new observation acts on nothing stamped on the old one
    rt.set_observation(*observation(rng), stamp_ns=9000 * MS)
    rt.step(9000 * MS)
    rt.reset_clock()
    r = rt.step(30 * MS)
    assert r.actions is None and "in the future" in r.reason


def test_warmup_freezes_the_collector_heap_and_close_lets_it_go():
    """warmup() ends with gc.freeze(): what is alive then (weights, buffers, graphs) is never walked by a
    later collection, so no tick pays for a full one. Objects made afterwards are still collected; a runtime
    dropped without close() is still freed (by reference counting); close() of the last runtime that froze
    the heap unfreezes it, and one still warm keeps it frozen."""
    import gc
    import weakref

    from flashrt_core.contract import runtime as runtime_module

    runtime_module._GC_FROZEN.clear()  # (runtimes of other tests)
    gc.unfreeze()
    try:
        rt = make_runtime()
        rt.warmup(freeze_gc=False)
        assert gc.get_freeze_count() == 0
        rt.warmup()
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the binding's weights are among the frozen objects: no collection walks them
        assert not any(o is rt.binding.w for o in gc.get_objects())
        rng = np.random.default_rng(0)
        rt.set_prompt("stack the cups")
        rt.set_observation(*observation(rng), stamp_ns=0)
        assert rt.step(0).actions is not None  # the runtime works as before
        cycle = [None]
        cycle[0] = cycle
        del cycle
        assert gc.collect() >= 1  # garbage made after the warm-up is collected as before

        other = make_runtime(seed=1)
        other.warmup()
        gone = weakref.ref(other), weakref.ref(other.binding), weakref.ref(other.binding.w["a"])
        del other  # dropped without close(): reference counting frees it all, frozen or not
        assert all(w() is None for w in gone)

        second = make_runtime(seed=2)
        second.warmup()
        weights = weakref.ref(rt.binding.w["a"])
        rt.close()  # another runtime is still warm: the heap stays frozen
        assert weights() is None and gc.get_freeze_count() > 0
        second.close()  # the last one: unfrozen
        assert gc.get_freeze_count() == 0
    finally:
        runtime_module._GC_FROZEN.clear()
        gc.unfreeze()


def test_step_reports_each_stage_host_part():
    """host_latency_ms: the host part of every stage that ran (a deferred one's too, run after the actions),
    each within its stage_latency_ms entry."""
    rt = make_runtime(deferred=True)
    rng = np.random.default_rng(1)
    rt.set_prompt("fold the towel")
    for t in (0, 20, 40, 60, 80, 100):
        rt.set_observation(*observation(rng), stamp_ns=t * MS)
        r = rt.step(t * MS)
        assert set(r.host_latency_ms) == set(r.ran)
        assert all(0 <= r.host_latency_ms[s] <= r.stage_latency_ms[s] for s in r.ran)
    assert r.deferred == ["observe"] and "observe" in r.host_latency_ms


def test_host_copy_is_torchs_copy_on_one_thread():
    """contract.buffers.host_copy: the values torch's copy_ gives (casts included), numpy doing the memcpy;
    bfloat16 (no numpy dtype) through torch."""
    from flashrt_core.contract.buffers import host_copy

    rng = np.random.default_rng(3)
    cases = [(torch.zeros(2, 224, 224, 3, dtype=torch.uint8), rng.integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)),
             (torch.zeros(8), rng.standard_normal(8)),  # float64 into float32: cast as copy_ casts
             (torch.zeros(5, dtype=torch.bool), np.array([1, 0, 1, 1, 0], dtype=bool)),
             (torch.zeros(3, dtype=torch.int64), torch.tensor([4, -2, 9])),
             (torch.zeros(4, dtype=torch.bfloat16), torch.randn(4))]
    for dst, src in cases:
        want = dst.clone().copy_(src if isinstance(src, torch.Tensor) else torch.from_numpy(src))
        host_copy(dst, src)
        assert torch.equal(dst, want), dst.dtype
