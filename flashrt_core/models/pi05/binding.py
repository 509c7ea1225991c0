"""pi0.5 behind a contract: the family's binding (`paligemma.binding`) with pi0.5's prompt.

- prompt (host, on a new prompt): cleans the task text into the persistent host buffer `task`.
- observe: the host part normalizes the robot state with the checkpoint's statistics and tokenizes
  "Task: ..., State: ...;" (pi0.5 puts the discretized state into the prompt, so the tokens change with every
  observation) and stages them; the device part fills the persistent prefix K/V from the camera frames.
- act: the family's (noise, RTC, the flow steps over the cached prefix).
"""
from __future__ import annotations

import numpy as np
import torch

from flashrt_core.contract.inputs import decode_prompt, encode_prompt
from flashrt_core.errors import InputError
from flashrt_core.lerobot.tokenize import tokenize_prompt
from flashrt_core.models.paligemma.binding import PaliGemmaBinding
from flashrt_core.models.pi05.policy import Pi05Policy, make_engine
from flashrt_core.models.pi05.prompt import clean_task, format_prompt
from flashrt_core.models.pi05.weights import convert


class Pi05Binding(PaliGemmaBinding):
    name = "pi05"

    def model_parts(self) -> tuple:
        return convert, make_engine, Pi05Policy

    def check_prompt(self, text: str) -> None:
        self.prompt_fits(self.policy.tokenizer, self.dims, text)

    @classmethod
    def prompt_fits(cls, tokenizer, dims, text: str) -> None:
        """InputError when the task with a state of three-digit bins (the longest text a state gives) does not
        fit in prompt_len tokens, so that set_prompt refuses it rather than every observe after it. (Token
        counts of digits depend on the tokenizer: the observe stage still refuses any prompt that does not
        fit, never truncating it.)"""
        task = clean_task(text)
        widest = np.full(dims["state_dim"], 1.0, dtype=np.float32)  # bin 255
        try:
            tokenize_prompt(tokenizer, format_prompt(task, widest), dims["prompt_len"], truncate=False)
        except InputError as exc:
            raise InputError(f"{exc} (task of {len(task)} characters with {dims['state_dim']} state values; "
                             "shorten the task, or raise model.options.prompt_len: the checkpoint's "
                             "tokenizer_max_length)") from None

    # ---- stages ----------------------------------------------------------------------------------------
    def host(self, stage, io):
        if stage == "prompt":
            text = clean_task(decode_prompt(io.host("prompt")))
            io.host("task").copy_(torch.from_numpy(encode_prompt(text or " ", io.host("task").shape[0])))
        elif stage == "observe":
            state = self.normalizer.normalize_state(io.host("state"))
            text = format_prompt(decode_prompt(io.host("task")), state.numpy())
            # not truncated: the state comes last, and cutting it off would leave a policy blind to the robot
            tokens, mask = tokenize_prompt(self.policy.tokenizer, text, self.dims["prompt_len"], truncate=False)
            io.to_device("lang_tokens", tokens[0])
            io.to_device("lang_mask", mask[0])
            io.to_device("state_offset", self._state_offset(io.host("state")))
        else:
            super().host(stage, io)
