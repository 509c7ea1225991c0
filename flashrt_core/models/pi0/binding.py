"""pi0 behind a contract: the slow `observe` stage builds the prefix from the cameras and the prompt only; the
fast `act` stage reads the robot state at its own rate (pi0 puts the state in the action expert's suffix, so
act at 50 Hz uses fresh proprioception over a 10 Hz prefix: the point of the fast/slow split).

- prompt: the task text as given (pi0's processors do not clean it) into the persistent host `task`.
- observe: host part tokenizes the task with a newline appended; device part: frames -> prefix K/V.
- act: host part normalizes the state (the checkpoint's statistics), pads it to max_state_dim (`act_state`),
  stages the absolute-actions offset of that state (`action_offset`) and draws the noise; device part: the
  flow steps over the cached prefix with that state, un-normalized actions plus the offset.
Everything else (options, processors, tokenizer, relative actions, the fused engine's stage graphs with their
hooks, the whole decision as one graph) is the family's binding (`paligemma.binding`); pi0 states what differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt_core.contract.bindings.flow import (observe_reads, prefix_cache, prefix_signature, prompt_signature,
                                                rtc_writes, token_writes)
from flashrt_core.models.paligemma.binding import PaliGemmaBinding
from flashrt_core.contract.inputs import decode_prompt, encode_prompt
from flashrt_core.contract.spec import StageSignature
from flashrt_core.errors import ContractError, InputError
from flashrt_core.models.pi0.policy import Pi0Policy, make_engine, pi0_prompt
from flashrt_core.models.pi0.weights import convert
from flashrt_core.lerobot.tokenize import tokenize_prompt


class Pi0Binding(PaliGemmaBinding):
    name = "pi0"

    @classmethod
    def dims(cls, model) -> dict[str, int]:
        return {**super().dims(model), "max_state_dim": cls.model_config(model).state_dim}

    @classmethod
    def signatures(cls, d, model) -> dict[str, StageSignature]:
        chunk = ((d["chunk"], d["max_action_dim"]), "float32")
        prefix = prefix_signature(d, model)
        return {
            "prompt": prompt_signature(d),
            "observe": StageSignature(reads=observe_reads(d), writes={**token_writes(d), **prefix}),
            "act": StageSignature(
                reads={**prefix, "state": ((d["state_dim"],), "float32")},
                writes={"act_state": ((d["max_state_dim"],), "float32"),
                        "action_offset": ((d["action_dim"],), "float32"), "noise": chunk, **rtc_writes(d),
                        "prev_chunk": chunk,
                        "actions": ((d["chunk"], d["action_dim"]), "float32")}),
        }

    def model_parts(self) -> tuple:
        return convert, make_engine, Pi0Policy

    @classmethod
    def prompt_fits(cls, tokenizer, dims, text: str) -> None:
        """InputError when the task does not fit prompt_len tokens (refused at set_prompt, never cut)."""
        try:
            tokenize_prompt(tokenizer, pi0_prompt(text), dims["prompt_len"], truncate=False)
        except InputError as exc:
            raise InputError(f"{exc} (shorten the task, or raise model.options.prompt_len: the checkpoint's "
                             "tokenizer_max_length)") from None

    # ---- stages ----------------------------------------------------------------------------------------
    def host(self, stage, io):
        d = self.dims
        if stage == "prompt":
            text = decode_prompt(io.host("prompt"))
            io.host("task").copy_(torch.from_numpy(encode_prompt(text or " ", io.host("task").shape[0])))
        elif stage == "observe":
            tokens, mask = tokenize_prompt(self.policy.tokenizer, pi0_prompt(decode_prompt(io.host("task"))),
                                           d["prompt_len"], truncate=False)
            io.to_device("lang_tokens", tokens[0])
            io.to_device("lang_mask", mask[0])
        elif stage == "act":
            raw = io.host("state")
            state = self.normalizer.normalize_state(raw).float()
            io.to_device("act_state", F.pad(state, (0, d["max_state_dim"] - state.shape[0])))
            io.to_device("action_offset", self._state_offset(raw))
            io.to_device("noise", torch.randn(d["chunk"], d["max_action_dim"], generator=io.generator))
            self._rtc_host(io)

    def device_part(self, stage):
        if hasattr(self.policy.engine, "run_stage"):  # the fused engine: the family's hooks, with pi0's act inputs
            return super().device_part(stage)
        return {"observe": self._prefix_into, "act": self._act}.get(stage)

    def _after_observe(self, b) -> None:
        """(pi0's absolute-actions offset comes from the act stage's state, not from the observation)"""

    def _act_inputs(self, engine, b) -> None:
        engine.buffers.state.copy_(b["act_state"][None])
        super()._act_inputs(engine, b)  # (the noise, and RTC's)

    def _act(self, b) -> None:
        chunk = self.policy.denoise(prefix_cache(b), b["act_state"][None], b["noise"][None],
                                    rtc=self._rtc_inputs(b))[0]
        b["prev_chunk"].copy_(chunk)
        b["actions"].copy_(self._robot_actions(chunk, b))
