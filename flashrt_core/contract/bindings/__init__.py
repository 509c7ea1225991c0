"""Model bindings: what a contract's `model:` section names.

A binding tells the contract its dims (for symbolic shapes) and what each of its stages reads and writes,
and gives the runtime each stage as two parts:
- `host(stage, io)`: CPU work that only reads host data (inputs, host buffers, the runtime's generator) and
  stages what the device needs (`io.to_device(name, cpu_tensor)`); it never reads device results, so all
  host parts of a plan can run before its device work is launched;
- `device(stage, bufs)`: pure tensor work on the static buffers, in place, with no host syncs, so it can be
  captured as a CUDA graph.
The runtime itself knows nothing about any model.
"""
from __future__ import annotations

import importlib
from typing import Any, Iterable, Mapping

from flashrt_core.errors import ContractError



class ModelBinding:
    """Base class; subclasses fill in the class methods (cheap, no weights) and the stage parts."""

    name = "model"

    # ---- contract side (no weights loaded) ----
    @classmethod
    def dims(cls, model) -> Mapping[str, int]:
        raise NotImplementedError

    @classmethod
    def signatures(cls, dims: Mapping[str, int], model) -> Mapping[str, Any]:
        """stage name -> StageSignature(reads={buf: (shape, dtype)}, writes={...})."""
        raise NotImplementedError

    # ---- runtime side ----
    def __init__(self, model, dims: Mapping[str, int], device, dtype, seed: int, tokenizer=None):
        self.model, self.dims, self.device, self.dtype, self.seed = model, dict(dims), device, dtype, seed

    def attach_buffers(self, bufs) -> None:
        """Called once with the runtime's buffers ({name: tensor}, fixed addresses) before any stage runs: an
        engine with static buffers of its own may take the contract's persistent ones as its own here, so
        that no stage copies between the two (default: nothing)."""

    def debug_graphs(self, on: bool) -> None:
        """Graphs the binding's engine captures itself (`owns_graphs`) check before every replay that no buffer
        moved since capture (the runtime's `debug_graphs`; default: nothing to check)."""

    def restored(self, bufs, rewind_time: bool) -> None:
        """Called after a capsule restore wrote the persistent buffers: state that describes the world rather
        than the model (what the robot is executing now) may need to follow a live restore (default: nothing)."""

    def host(self, stage: str, io) -> None:
        """Host part of a stage (default: nothing)."""

    def device_part(self, stage: str):
        """A callable(bufs) doing the stage's device work, or None for host-only stages."""
        return None

    def device_plan(self, stages):
        """A callable(bufs) doing the device work of `stages` (a plan of two or more, in order) better than
        their device parts one after another would (e.g. overlapped in one graph of the model's engine), or
        None: then the runtime runs the parts in turn. The result must be what the parts give."""
        return None

    def identity(self) -> str:
        """Model identity for fingerprints (architecture and sizes, not the weights)."""
        return self.name

    def weights(self) -> Iterable[tuple[str, Any]]:
        """(name, tensor) of every weight, for the weights digest."""
        return ()


def resolve_binding(name: str):
    """The binding class for `model.name`: a registry kind (`flashrt_core.models.registry`) or
    "package.module:Class"."""
    from flashrt_core.models import registry

    target = registry.MODELS[name].binding if name in registry.MODELS else name
    if ":" not in target:
        raise ContractError(f"model.name: unknown model {name!r} (built-in: {', '.join(registry.MODELS)}; "
                            "or give package.module:Class)")
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ContractError(f"model.name: cannot load binding {target!r}: {e}") from None
    return cls


def image_pad(model) -> str:
    """Where the padding goes when a camera frame is fitted to the contract's image size: the model's own
    convention (its binding's IMAGE_PAD), so that the node, the replay and the device step fit frames alike."""
    return getattr(resolve_binding(model.name), "IMAGE_PAD", "centre")
