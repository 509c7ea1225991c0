"""A Runtime's host-side state at a decision boundary, as capsules carry it (the buffers go separately).

`runtime_meta` takes it (ledger, rate clocks, pending waits, noise RNG, prompt, the input watermark);
`check_meta` tells, before the first byte of a restore moves, whether `apply_meta` could fail or mix
another contract's state in; `apply_meta` puts it back in place. Two ways back:
- live (rewind_time=False, what `Runtime.restore` does unless asked): the model state rewinds (ledger,
  RNG, prompt) but the rate clocks, pending waits and the input watermark (the stamp of the last
  observation) stay as they are now. The next tick runs what the grid has due now (no burst of every stage
  with their missed grid points counted), and the robot's next observations, stamped later, are taken.
- rewind (rewind_time=True): the clocks, waits and watermark return to the snapshot's too, so feeding the
  same observations on the same clock again replays the snapshotted branch bit for bit.
Observation inputs (their contents and their ledger entries) stay live in both: they are the robot's newest
frames, which a restore does not rewind.
"""
from __future__ import annotations

from typing import Mapping

import torch

from flashrt_core.errors import CapsuleError


def runtime_meta(rt) -> dict:
    with rt._lock:
        ledger = rt.buffers.ledger
        meta = {
            "decisions": ledger.decisions,
            "step": ledger.step,
            "ledger": ledger.to_dict(),
            "clocks": {n: [c.t0, c.n] for n, c in rt.scheduler.clocks.items()},
            "pending": sorted(rt.scheduler.pending),
            "rng_state": rt.generator.get_state().clone(),
            "prompt": rt._prompt,
            "last_stamp_ns": rt._last_stamp,
            "seed": rt.seed,
        }
        if "prompt" in rt.buffers.tensors:
            meta["prompt_bytes"] = rt.buffers.host_view("prompt").clone()
        return meta


def check_meta(rt, meta: Mapping) -> None:
    """Raise CapsuleError naming the field if `apply_meta(meta)` could fail or mix another contract's state
    in (other stages, clocks, buffers). Runs on every restore of a new capsule: messages are formatted only
    on failure, and dicts are plain `dict`s (what runtime_meta() and capsules hold; the typing.Mapping check
    alone would double its cost)."""

    def fail(field, why):
        raise CapsuleError(f"meta field {field}: {why} (is the capsule from another runtime or contract?)")

    def names(got, want, field):
        if not isinstance(got, dict):
            fail(field, f"expected a dict, got {type(got).__name__}")
        if got.keys() != want:
            fail(field, f"names differ from this runtime's: missing {sorted(want - got.keys())}, "
                        f"unexpected {sorted(map(str, got.keys() - want))}")

    def ints(d, field):
        for k, v in d.items():
            if type(v) is not int:
                fail(f"{field}.{k}", f"expected an int, got {v!r}")

    def tensor_like(got, want, field):
        if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape):
            fail(field, f"expected a {want.dtype} tensor of shape {tuple(want.shape)}, got "
                 + (f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__))

    if not isinstance(meta, dict):
        fail("meta", f"expected a dict, got {type(meta).__name__}")
    for key in ("ledger", "clocks", "pending", "rng_state", "prompt"):
        if key not in meta:
            fail(key, "missing")
    contract = rt.contract
    stages, led = contract.stages, meta["ledger"]
    if not isinstance(led, dict):
        fail("ledger", f"expected a dict, got {type(led).__name__}")
    for key in ("buffers", "seen", "runs", "misses", "lates", "step", "decisions"):
        if key not in led:
            fail(f"ledger.{key}", "missing")
    names(led["buffers"], contract.buffers.keys(), "ledger.buffers")
    for name, e in led["buffers"].items():
        if not (isinstance(e, (list, tuple)) and len(e) == 3 and type(e[0]) is int and type(e[1]) is int
                and (e[2] is None or type(e[2]) is int)):
            fail(f"ledger.buffers.{name}", f"expected [version, step, stamp_ns or None], got {e!r}")
    names(led["seen"], stages.keys(), "ledger.seen")
    for stage, seen in led["seen"].items():
        names(seen, set(stages[stage].reads), f"ledger.seen.{stage}")
        ints(seen, f"ledger.seen.{stage}")
    for key in ("runs", "misses", "lates"):
        names(led[key], stages.keys(), f"ledger.{key}")
        ints(led[key], f"ledger.{key}")
    ints({"step": led["step"], "decisions": led["decisions"]}, "ledger")
    names(meta["clocks"], rt.scheduler.clocks.keys(), "clocks")
    for name, c in meta["clocks"].items():
        if not (isinstance(c, (list, tuple)) and len(c) == 2 and (c[0] is None or type(c[0]) is int)
                and type(c[1]) is int):
            fail(f"clocks.{name}", f"expected [t0 or None, n], got {c!r}")
    pending = meta["pending"]
    if not (isinstance(pending, (list, tuple, set)) and all(p in stages for p in pending)):
        fail("pending", f"expected stage names of this contract, got {pending!r}")
    stamp = meta.get("last_stamp_ns")
    if not (stamp is None or type(stamp) is int):
        fail("last_stamp_ns", f"expected nanoseconds or None, got {stamp!r}")
    tensor_like(meta["rng_state"], rt.generator.get_state(), "rng_state")
    if not (meta["prompt"] is None or isinstance(meta["prompt"], str)):
        fail("prompt", f"expected a string or None, got {type(meta['prompt']).__name__}")
    if "prompt_bytes" in meta and "prompt" in rt.buffers.tensors:
        tensor_like(meta["prompt_bytes"], rt.buffers.host_view("prompt"), "prompt_bytes")


def apply_meta(rt, meta: Mapping, rewind_time: bool = True) -> None:
    """Put host-side state back from `runtime_meta()` output (see the module doc for the two ways).

    In place, without new objects: a restore runs between two control ticks. `check_meta` has vetted that
    every name matches this contract, so updating is the same as replacing."""
    with rt._lock:
        live, src = rt.buffers.ledger, meta["ledger"]
        keep = rt._live_inputs
        for name, (version, step, stamp) in src["buffers"].items():
            if name not in keep:
                m = live.buffers[name]
                m.version, m.step, m.stamp_ns = version, step, stamp
        for stage, seen in src["seen"].items():
            live.seen[stage].update(seen)
        live.runs.update(src["runs"])
        live.misses.update(src["misses"])
        live.lates.update(src["lates"])
        live.step, live.decisions = src["step"], src["decisions"]
        rt.buffers.device_version.update(rt._restage)  # re-stage device copies of inputs on next use
        if rewind_time:
            for name, (t0, n) in meta["clocks"].items():
                rt.scheduler.clocks[name].t0, rt.scheduler.clocks[name].n = t0, n
            rt.scheduler.pending = set(meta["pending"])
            rt._last_stamp = meta.get("last_stamp_ns")
        rt.generator.set_state(meta["rng_state"])  # copies the bytes: no reference kept
        rt._prompt = meta["prompt"]
        if "prompt_bytes" in meta and "prompt" in rt.buffers.tensors:
            rt.buffers.host_view("prompt").copy_(meta["prompt_bytes"])
