"""SmolVLA behind a contract: the shared flow binding (`flashrt_core.contract.bindings.flow`) with SmolVLA's
sizes, weights, prompt and state token.

- prompt: the task text as given (SmolVLA's processors do not clean it) into the persistent host `task`.
- observe: the host part tokenizes the task with a newline appended (no BOS; cut at the checkpoint's
  max_length, as LeRobot's tokenizer step cuts it: the state is a token of its own, not in the prompt) and
  normalizes the robot state, zero padded to max_state_dim (`obs_state`); the device part turns the frames
  (resized with padding on the top and left, as LeRobot's SmolVLA does) and those into the prefix K/V.
- act: the shared one (noise, the flow steps over the cached prefix, un-normalized actions).
Model options, besides the shared ones: vlm (the folder of the VLM's config.json and tokenizer; default: the
hub cache of the checkpoint's vlm_model_name). SmolVLA needs a checkpoint (there is no built-in one).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt_core.contract.bindings.flow import FlowBinding
from flashrt_core.contract.inputs import decode_prompt, encode_prompt
from flashrt_core.errors import ContractError
from flashrt_core.lerobot.policy import checkpoint_folder, choose_tokenizer, with_processor_settings
from flashrt_core.lerobot.tokenize import tokenize_prompt
from flashrt_core.models.smolvla.policy import SmolVLAPolicy, make_engine, read_config, smolvla_prompt
from flashrt_core.models.smolvla.weights import convert


class SmolVLABinding(FlowBinding):
    name = "smolvla"
    OPTIONS = FlowBinding.OPTIONS - {"variant"} | {"vlm"}
    IMAGE_PAD = "top_left"

    @classmethod
    def base_config(cls, model, procs):
        if not model.checkpoint:
            raise ContractError("model.checkpoint: model smolvla needs a checkpoint (there is no built-in smolvla "
                                "model)")
        config, _ = read_config(checkpoint_folder(model.checkpoint), model.options.get("vlm"))
        return with_processor_settings(config, procs)

    @classmethod
    def sizes(cls, c) -> dict[str, int]:
        return {"layers": c.expert.depth, "kv_heads": c.expert.kv_heads, "head_dim": c.expert.head_dim,
                "prefix_len": c.prefix_len, "chunk": c.chunk_size, "max_action_dim": c.max_action_dim,
                "max_state_dim": c.max_state_dim, "image_size": c.image_size, "vocab": c.vocab_size}

    @classmethod
    def describe_sizes(cls, config, dims) -> str:
        return (f"VLM width {config.vlm.width} x {config.vlm.depth} layers, expert width {config.expert.width} x "
                f"{config.expert.depth} layers, vocab {config.vocab_size}, chunk {config.chunk_size}, "
                f"{config.num_steps} flow steps, images {config.image_size} px, prompt {dims['prompt_len']} tokens")

    @classmethod
    def tokenizer_for(cls, model, config, procs, tokenizer=None):
        """Given, the contract's option, else the SmolVLM2 tokenizer beside the VLM's config (the hub snapshot)."""
        explicit = tokenizer if tokenizer is not None else model.options.get("tokenizer")
        if explicit is None:
            explicit = read_config(checkpoint_folder(model.checkpoint), model.options.get("vlm"))[1]
        return choose_tokenizer(config, checkpoint_folder(model.checkpoint), explicit, procs)

    @classmethod
    def observe_writes(cls, d) -> dict:
        return {"obs_state": ((d["max_state_dim"],), "float32")}

    @classmethod
    def dims(cls, model) -> dict[str, int]:
        return {**super().dims(model), "max_state_dim": cls.model_config(model).max_state_dim}

    def load_state(self, model, config, seed: int, device) -> dict:
        from safetensors.torch import load_file

        return load_file(str(checkpoint_folder(model.checkpoint) / "model.safetensors"))

    def model_parts(self) -> tuple:
        return convert, make_engine, SmolVLAPolicy

    @classmethod
    def prompt_fits(cls, tokenizer, dims, text: str) -> None:
        """Every prompt fits: LeRobot cuts SmolVLA's at max_length, and so does the observe stage (the state is a
        token of its own: cutting the prompt loses no proprioception)."""
        smolvla_prompt(text)

    def observation(self, b, images, masks) -> tuple:
        return images[None], masks[None], b["lang_tokens"][None], b["lang_mask"][None], b["obs_state"][None]

    # ---- stages ----------------------------------------------------------------------------------------
    def host(self, stage, io):
        d = self.dims
        if stage == "prompt":
            text = decode_prompt(io.host("prompt"))
            io.host("task").copy_(torch.from_numpy(encode_prompt(text or " ", io.host("task").shape[0])))
        elif stage == "observe":
            tokens, mask = tokenize_prompt(self.policy.tokenizer, smolvla_prompt(decode_prompt(io.host("task"))),
                                           d["prompt_len"], truncate=True, bos=False)
            io.to_device("lang_tokens", tokens[0])
            io.to_device("lang_mask", mask[0])
            state = self.normalizer.normalize_state(io.host("state")).float()
            io.to_device("obs_state", F.pad(state, (0, d["max_state_dim"] - state.shape[0])))
            io.to_device("state_offset", self._state_offset(io.host("state")))
        else:
            super().host(stage, io)
