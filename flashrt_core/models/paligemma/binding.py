"""The PaliGemma family behind a contract (what pi0.5's and pi0's bindings share): its sizes, its weights (a
checkpoint, the built-in tiny model, or the full-size model with random weights) and the family's model options.
Everything else is the shared flow binding (`flashrt_core.contract.bindings.flow`); each model's `binding.py`
adds its prompt and its policy.

Model options (contract `model.options`), besides the shared ones: variant (tiny | full, without a checkpoint).
"""
from __future__ import annotations


from flashrt_core.contract.bindings.flow import FlowBinding
from flashrt_core.errors import ContractError
from flashrt_core.models import registry
from flashrt_core.models.paligemma.checkpoint import checkpoint_config, load_checkpoint
from flashrt_core.models.paligemma.tiny import build_tiny
from flashrt_core.models.random_weights import random_state


class PaliGemmaBinding(FlowBinding):
    """The family's binding; a model's subclass sets `name` and gives `make_policy`, `prompt_fits` and the
    host parts of `prompt` / `observe` (its prompt)."""

    @classmethod
    def base_config(cls, model, procs):
        if model.checkpoint:
            return checkpoint_config(model.checkpoint, validate=True)
        if cls.name != registry.DEFAULT_KIND:
            raise ContractError(f"model.checkpoint: model {cls.name} needs a checkpoint (there is no built-in "
                                f"{cls.name} model)")
        variant = model.options.get("variant", "tiny")
        if variant not in ("tiny", "full"):
            raise ContractError(f"model.options.variant: tiny or full, got {variant!r}")
        own = registry.config_class(cls.name)
        return own.tiny() if variant == "tiny" else own.full()

    @classmethod
    def sizes(cls, c) -> dict[str, int]:
        return {"layers": c.vlm.depth, "kv_heads": c.vlm.kv_heads, "head_dim": c.vlm.head_dim,
                "prefix_len": c.prefix_len, "chunk": c.chunk_size, "max_action_dim": c.action_dim,
                "max_state_dim": c.state_dim, "image_size": c.vision.image_size, "vocab": c.vocab_size}

    @classmethod
    def describe_sizes(cls, config, dims) -> str:
        return (f"prefix width {config.vlm.width} x {config.vlm.depth} layers, expert width {config.expert.width}, "
                f"vocab {config.vocab_size}, chunk {config.chunk_size}, {config.num_steps} flow steps, prompt "
                f"{dims['prompt_len']} tokens")

    def load_state(self, model, config, seed: int, device) -> dict:
        if model.checkpoint:
            return load_checkpoint(model.checkpoint)[1]
        if model.options.get("variant", "tiny") == "tiny":
            return build_tiny(seed, registry.config_class(self.name).tiny())[1]
        return random_state(config, seed, device)  # (fan-in scaled: every path moves the output)

