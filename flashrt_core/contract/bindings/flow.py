"""A LeRobot flow-matching policy behind a contract: what every model's binding shares, whatever the model.

Stages `prompt` (on a new prompt: the task into the persistent host buffer `task`), `observe` (cameras, prompt
and, for models that read it there, the state -> the persistent prefix K/V) and `act` (noise -> the flow steps
of the action expert over the cached prefix -> the persistent `prev_chunk` and the output `actions`); a model's
binding (`models/<kind>/binding.py`) gives its sizes (`model_config`, `sizes`), its weights (`load_state`,
`make_policy`), its prompt (`prompt_fits`, the host parts of `prompt` / `observe`) and what its engine's
observation holds besides frames and tokens (`observation`).
Spaces: `state` is in robot units (normalized on the host); `noise` and `prev_chunk` are in the model's
normalized action space (all max_action_dim columns); `actions` is in robot units (the first action_dim
columns, un-normalized by the LeRobot post-processor statistics beside the checkpoint). The built-in models
and checkpoints without stats files use identity normalization; a checkpoint whose config.json normalizes
without the statistics is refused (a contract runs in robot units).
A LeRobot checkpoint folder brings its own processors (`flashrt_core.lerobot.processors`): the camera
features (slot order), state and action widths, normalization, relative actions, tokenizer name and prompt
length. With relative actions, observe stages the raw state on the relative columns (`state_offset`) and
keeps it beside the prefix it belongs to (`action_offset`); act adds it to the un-normalized actions.
Model options (contract `model.options`): variant (tiny | full, without a checkpoint), views (cameras the
robot sends; default: the checkpoint's camera features), image_height, image_width (the frames' size in the
`images` buffer), action_dim / state_dim (default: the checkpoint's; a contract value must agree with it),
prompt_len, prompt_bytes, image_slots, engine (auto: fused on CUDA, reference on CPU; fused; reference),
tokenizer (a tokenizer.json / tokenizer.model path; default: resolved by the checkpoint's tokenizer name),
vision_dtype (float32 as LeRobot keeps SigLIP, or model: the model dtype; default model for the fused engine,
whose bf16 SigLIP meets the LeRobot parity targets at half the observe time, float32 for the reference),
rtc (real-time chunking, off by default; `model_options.rtc_options`), precision (a preset of
`flashrt_core.models.precision.PRESETS` or a mapping per part; default bf16) and precision_gate ({cosine,
rel_l2}: the load check's thresholds against the unquantized model; default the format's).

Real-time chunking (`model.options.rtc: {execution_horizon, max_guidance_weight, schedule, inference_delay,
action_rate_hz}`): every act tick guides its chunk towards the part of the previous chunk the robot has not
executed yet (LeRobot 0.6.1's RTC, `flashrt_core.models.rtc`). The robot is taken to execute the newest chunk
from its tick on, one action per 1 / action_rate_hz; act's host part counts the actions executed since the
previous chunk (`rtc_clock`, act's own persistent state: capsules carry it) and stages that shift
(`rtc_shift`) and the prefix weights of the inference delay and horizon (`rtc_weights`); its device part
takes the previous chunk's rest from `prev_chunk` (act's own persistent output, read before act overwrites
it) and runs the guided flow (the fused engine's "act+rtc" graph).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np
import torch

from flashrt_core.contract.bindings import ModelBinding
from flashrt_core.contract.bindings.model_options import precision_options, rtc_options
from flashrt_core.contract.inputs import decode_prompt, encode_prompt
from flashrt_core.contract.spec import StageSignature
from flashrt_core.errors import ContractError, InputError
from flashrt_core.lerobot.normalize import Normalizer
from flashrt_core.lerobot.policy import choose_tokenizer, resolve_engine
from flashrt_core.lerobot.preprocess import resize_with_pad
from flashrt_core.lerobot.processors import Processors, read_processors
from flashrt_core.models import registry, rtc

_OPTIONS = {"rtc", "variant", "views", "image_height", "image_width", "action_dim", "state_dim", "prompt_len",
            "prompt_bytes", "image_slots", "engine", "vision_dtype", "tokenizer", "precision", "precision_gate"}
DEFAULT_VIEWS, DEFAULT_STATE_DIM, DEFAULT_ACTION_DIM = 2, 8, 7  # without a checkpoint that says


def model_config(binding, model):
    """Sizes of the model a contract names (no weights read): the binding's `base_config` (checkpoint shapes,
    or a built-in variant) with the run-time fields (camera slots, prompt length) from the options and the
    checkpoint's processors."""
    opts = dict(model.options)
    unknown = sorted(set(opts) - binding.OPTIONS)
    if unknown:
        raise ContractError(f"model.options.{unknown[0]}: unknown option for {binding.name} "
                            f"(expected: {', '.join(sorted(binding.OPTIONS))})")
    procs = checkpoint_processors(model)
    if model.checkpoint:
        if not pathlib.Path(model.checkpoint).exists():
            raise ContractError(f"model.checkpoint: {model.checkpoint} not found")
        kind = registry.checkpoint_kind(model.checkpoint)
        if kind != binding.name:
            raise ContractError(f"model.name: {binding.name}, but {model.checkpoint} is a {kind} checkpoint "
                                f"(use a {kind} contract, e.g. the packaged config/{registry.entry(kind).contract})")
    config = binding.base_config(model, procs)
    cameras = len(procs.camera_names) if procs is not None else 0
    views = _views(opts, procs)
    slots = _positive(opts, "image_slots", max(views, cameras))
    if slots < views:
        raise ContractError(f"model.options.image_slots: {slots} is fewer than views ({views})")
    return dataclasses.replace(config, num_image_slots=slots, tokenizer_max_length=prompt_length(opts, config, procs))


def prompt_length(opts, config, procs: Processors | None) -> int:
    """The padded prompt's length in tokens: the contract's prompt_len, never past what the checkpoint's
    tokenizer step pads to (its max_length: a longer prompt LeRobot would cut, so FlashRT refuses it). A shorter
    contract value only pads less (padding is masked: the same actions, a shorter prefix)."""
    limit = procs.tokenizer_max_length if procs is not None and procs.tokenizer_max_length else None
    return min(_positive(opts, "prompt_len", limit or config.tokenizer_max_length), limit or 1 << 30)


def checkpoint_processors(model) -> Processors | None:
    """The processors of the contract's checkpoint folder (None without a checkpoint)."""
    if not model.checkpoint:
        return None
    if not pathlib.Path(model.checkpoint).exists():
        raise ContractError(f"model.checkpoint: {model.checkpoint} not found")
    procs = read_processors(model.checkpoint)
    if procs.normalizer.missing:  # (a contract runs in robot units: state in, actions out)
        raise ContractError(f"model.checkpoint: {procs.normalizer.missing}")
    return procs


def _views(opts, procs: Processors | None) -> int:
    """Cameras the robot sends: the checkpoint's camera features unless the contract says fewer (the rest are
    missing cameras, as in LeRobot)."""
    cameras = len(procs.camera_names) if procs is not None else 0
    views = _positive(opts, "views", cameras or DEFAULT_VIEWS)
    if cameras and views > cameras:
        raise ContractError(f"model.options.views: {views} cameras but the checkpoint has {cameras} camera features "
                            f"({', '.join(procs.camera_names)})")
    return views


def _robot_dim(opts, key: str, from_checkpoint: int | None, default: int) -> int:
    """state_dim / action_dim: the checkpoint's width; a contract or node value must agree with it."""
    if from_checkpoint is None:
        return _positive(opts, key, default)
    v = _positive(opts, key, from_checkpoint)
    if v != from_checkpoint:
        raise ContractError(f"model.options.{key}: {v} (the robot's joint count, or the contract's value), but the "
                            f"checkpoint's config.json says {from_checkpoint} (the robot's joints must match the "
                            "checkpoint's features)")
    return v


def _positive(opts, key, default) -> int:
    v = opts.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ContractError(f"model.options.{key}: must be a positive integer, got {v!r}")
    return v


class FlowBinding(ModelBinding):
    """The shared binding (see the module docstring); a model's subclass sets `name` (its registry kind) and
    gives the hooks below."""

    OPTIONS = frozenset(_OPTIONS)
    IMAGE_PAD = "centre"  # how the frames are fitted to the vision tower's square (`resize_with_pad`)

    # ---- the model's hooks -------------------------------------------------------------------------
    @classmethod
    def base_config(cls, model, procs):
        """The model's sizes before the run-time fields: the checkpoint's, or a built-in variant's."""
        raise NotImplementedError

    @classmethod
    def sizes(cls, config) -> dict[str, int]:
        """{layers, kv_heads, head_dim, prefix_len, chunk, max_action_dim, max_state_dim, image_size, vocab}
        of `config` (the prefix K/V the act stage reads: one entry per layer of the action expert that reads it)."""
        raise NotImplementedError

    @classmethod
    def describe_sizes(cls, config, dims) -> str:
        raise NotImplementedError

    def load_state(self, model, config, seed: int, device) -> dict:
        """The LeRobot-layout state dict: the checkpoint's, or a built-in model's weights."""
        raise NotImplementedError

    def observation(self, b, images, masks) -> tuple:
        """The engine's observation for the `observe` stage: (images, masks, lang_tokens, lang_mask, ...) with a
        batch of 1 (a model whose prefix reads the state adds it)."""
        return images[None], masks[None], b["lang_tokens"][None], b["lang_mask"][None]

    @classmethod
    def observe_writes(cls, d) -> dict:
        """What the model's observe stage writes besides the tokens, the state offset and the prefix (SmolVLA: the
        normalized state its prefix token reads)."""
        return {}

    @classmethod
    def model_config(cls, model):
        return model_config(cls, model)

    @classmethod
    def dims(cls, model) -> dict[str, int]:
        c = cls.model_config(model)
        z = cls.sizes(c)
        opts = model.options
        procs = checkpoint_processors(model)
        action_dim = _robot_dim(opts, "action_dim", procs.action_dim if procs else None,
                                min(DEFAULT_ACTION_DIM, z["max_action_dim"]))
        if action_dim > z["max_action_dim"]:
            raise ContractError(f"model.options.action_dim: {action_dim} exceeds the model's {z['max_action_dim']}")
        state_dim = _robot_dim(opts, "state_dim", procs.state_dim if procs else None, DEFAULT_STATE_DIM)
        if state_dim > z["max_state_dim"]:  # (the policy refuses longer states: the contract says so up front)
            raise ContractError(f"model.options.state_dim: {state_dim} exceeds the model's max_state_dim "
                                f"{z['max_state_dim']}")
        return {"views": _views(opts, procs), "image_height": _positive(opts, "image_height", 224),
                "image_width": _positive(opts, "image_width", 224), "state_dim": state_dim,
                "prompt_bytes": _positive(opts, "prompt_bytes", 256), "prompt_len": c.tokenizer_max_length,
                "slots": c.num_image_slots, "layers": z["layers"], "kv_heads": z["kv_heads"],
                "head_dim": z["head_dim"], "prefix_len": z["prefix_len"], "chunk": z["chunk"],
                "max_action_dim": z["max_action_dim"], "action_dim": action_dim}

    @classmethod
    def signatures(cls, d, model) -> dict[str, StageSignature]:
        chunk = ((d["chunk"], d["max_action_dim"]), "float32")
        offset = ((d["action_dim"],), "float32")
        prefix = {**prefix_signature(d, model), "action_offset": offset}
        return {
            "prompt": prompt_signature(d),
            "observe": StageSignature(
                reads={**observe_reads(d), "state": ((d["state_dim"],), "float32")},
                writes={**token_writes(d), **cls.observe_writes(d), "state_offset": offset, **prefix}),
            "act": StageSignature(reads=prefix, writes={"noise": chunk, **rtc_writes(d), "prev_chunk": chunk,
                                                        "actions": ((d["chunk"], d["action_dim"]), "float32")}),
        }

    @classmethod
    def engine_for(cls, model, device) -> str:
        """The engine `model.options.engine` names for `device` (auto: fused on CUDA, reference on CPU)."""
        try:
            return resolve_engine(model.options.get("engine", "auto"), device, model=registry.entry(cls.name).title)
        except ValueError as e:
            raise ContractError(f"model.options.{e}") from None

    @classmethod
    def tokenizer_for(cls, model, config, procs, tokenizer=None):
        """The tokenizer the model runs with (given, contract option, or the project's rule: choose_tokenizer)."""
        folder = None
        if model.checkpoint:
            folder = pathlib.Path(model.checkpoint)
            folder = folder if folder.is_dir() else folder.parent
        return choose_tokenizer(config, folder, tokenizer if tokenizer is not None else model.options.get("tokenizer"),
                                procs)

    @classmethod
    def plan(cls, model, dims, device, tokenizer=None, prompt: str | None = None) -> dict:
        """What `__init__` would build, without reading weights (flashrt run --dry-run); with `prompt`, also
        whether it fits (the check set_prompt makes)."""
        config = cls.model_config(model)
        procs = checkpoint_processors(model)
        engine = cls.engine_for(model, device)
        tok = cls.tokenizer_for(model, config, procs, tokenizer)
        pieces = getattr(tok, "vocab_size", None)
        if pieces is not None and pieces > config.vocab_size:
            raise InputError(f"tokenizer: {pieces} pieces but the model's vocabulary has {config.vocab_size} "
                             "(a tokenizer of another model?)")
        if prompt is not None:
            encode_prompt(prompt, dims["prompt_bytes"])
            cls.prompt_fits(tok, dims, prompt)
        vision = model.options.get("vision_dtype", "model" if engine == "fused" else "float32")
        precision = precision_options(model)[0]
        out = {"engine": engine, "vision dtype": model.dtype if vision == "model" else "float32",
               "precision": precision.name if precision.quantized else
               f"preset {precision.name}: nothing quantized, every part in {model.dtype}",
               "sizes": cls.describe_sizes(config, dims),
               "cameras": list(procs.camera_names) if procs and procs.camera_names
               else [f"slot {i}" for i in range(dims["views"])],
               "image slots": dims["slots"], "state": f"{dims['state_dim']} values",
               "actions": f"{dims['action_dim']} columns" + (f" ({', '.join(procs.action_names)})"
                                                             if procs and procs.action_names else "")}
        n = procs.normalizer if procs is not None else Normalizer.identity()
        out["normalization"] = f"state {n.state.mode}, action {n.action.mode} ({n.source})"
        out["relative actions"] = procs.describe_relative() if procs is not None else "off"
        for i, note in enumerate(procs.notes if procs is not None else ()):
            out[f"checkpoint note {i + 1}"] = note
        out["tokenizer"] = f"{type(tok).__name__} {getattr(tok, 'path', '')}".strip()
        return out

    def __init__(self, model, dims, device, dtype, seed, tokenizer=None):
        super().__init__(model, dims, device, dtype, seed, tokenizer)
        self.config = self.model_config(model)
        config = self.config
        self.image_size = self.sizes(config)["image_size"]
        state = self.load_state(model, config, seed, device)
        engine_name = self.engine_for(model, device)
        self.engine_name = engine_name
        vision = model.options.get("vision_dtype", "model" if engine_name == "fused" else "float32")
        if vision not in ("float32", "model"):
            raise ContractError(f"model.options.vision_dtype: float32 or model, got {vision!r}")
        procs = checkpoint_processors(model)
        # the tokenizer before the weights: a missing one is refused before minutes of loading
        tok = self.tokenizer_for(model, config, procs, tokenizer)
        self.precision, self.precision_gate = precision_options(model)
        self.policy = self.make_policy(config, state, engine_name, vision, tok, procs)
        del state
        self.owns_graphs = engine_name == "fused" and self.device.type == "cuda"
        self.processors = procs
        # state stats stay on the host (observe's host part); action stats live beside the actions
        self.normalizer = procs.normalizer if procs is not None else Normalizer.identity()
        self._action_norm = self.normalizer.to(self.device)
        mask = procs.relative_mask if procs is not None and procs.relative else None
        self._offset_mask = None if mask is None else torch.tensor(mask, dtype=torch.float32)
        self.rtc = rtc_options(model)
        if self.rtc is not None:
            self._rtc_rows = torch.arange(config.chunk_size, device=self.device)
            # the guided step's coefficients are a = dt + ca[s] w, b = cb[s] w with the tick's weights w
            # (models.rtc.step_factors): ca, cb per flow step, made once
            self._rtc_dt, ca, cb = rtc.step_factors(config.num_steps, self.rtc.options.max_guidance_weight)
            self._rtc_ca, self._rtc_cb = ca.to(self.device), cb.to(self.device)

    def model_parts(self) -> tuple:
        """(convert, make_engine, policy class) of the model: its weights from a LeRobot state dict, its engine
        by name, its policy (each model's binding)."""
        raise NotImplementedError

    def make_policy(self, config, state, engine_name: str, vision: str, tokenizer, processors):
        """The model behind the stages, on the binding's device and dtype (SigLIP in fp32 with vision float32)."""
        convert, make_engine, policy_class = self.model_parts()
        weights = convert(config, state).to(device=self.device, dtype=self.dtype,
                                            vision_dtype=torch.float32 if vision == "float32" else None)
        engine = make_engine(engine_name, weights, self.precision, self.precision_gate)
        return policy_class(config, weights, engine, self.device, self.dtype, seed=self.seed, tokenizer=tokenizer,
                            processors=processors)

    def check_prompt(self, text: str) -> None:
        self.prompt_fits(self.policy.tokenizer, self.dims, text)

    @classmethod
    def prompt_fits(cls, tokenizer, dims, text: str) -> None:
        """InputError when `text` cannot make a prompt of prompt_len tokens (each model's binding)."""
        raise NotImplementedError

    def host(self, stage, io):
        """The act stage's host part (the noise, RTC's inputs); a model's binding adds its prompt's stages."""
        if stage == "act":
            d = self.dims
            io.to_device("noise", torch.randn(d["chunk"], d["max_action_dim"], generator=io.generator))
            self._rtc_host(io)

    def _rtc_host(self, io) -> None:
        """RTC's per-tick inputs (see the module docstring): how many actions of the previous chunk the robot
        has executed by now (`rtc_shift`) and the prefix weights of what is left (`rtc_weights`: zeros where
        nothing is, i.e. a plain flow); this tick's chunk starts now (`rtc_clock`)."""
        if self.rtc is None:
            return
        r, chunk = self.rtc, self.dims["chunk"]
        clock = io.host("rtc_clock")
        start, valid = int(clock[0]), bool(clock[1])
        # (to the nearest action: a tick a little early or late counts the action due at it)
        executed = math.floor((io.now_ns - start) * r.action_rate_hz / 1e9 + 0.5) if valid else chunk
        executed = min(max(executed, 0), chunk)
        left = chunk - executed
        if left > 0:
            weights = rtc.prefix_weights(self._rtc_delay(io), min(r.options.execution_horizon, left), chunk,
                                         r.options.schedule)
        else:
            weights = torch.zeros(chunk)
        io.to_device("rtc_weights", weights)
        io.to_device("rtc_shift", torch.tensor([executed], dtype=torch.int64))
        clock.copy_(torch.tensor([io.now_ns, 1], dtype=torch.int64))

    def restored(self, bufs, rewind_time: bool) -> None:
        """RTC after a live restore: the robot still executes the chunk published before it, which the restored
        `prev_chunk` is not, so the next chunk is a plain flow (no guidance towards a plan that is not running);
        a rewind restore replays the snapshot's timeline, its chunk included, and keeps the guidance."""
        if self.rtc is not None and not rewind_time:
            bufs["rtc_clock"][1] = 0

    def _rtc_delay(self, io) -> int:
        """Actions the robot executes while this chunk is computed: the option, or ("auto") the act stage's
        latest measured latency over the action period, rounded up (1 before the first measurement)."""
        r = self.rtc
        if r.inference_delay != "auto":
            return r.inference_delay
        ms = io.stage_ms.get("act")
        return 1 if ms is None else max(0, math.ceil(ms * r.action_rate_hz / 1000.0))

    def _rtc_prev(self, b) -> torch.Tensor:
        """[1, chunk, max_action_dim]: the previous chunk past the executed actions, zero padded (model space;
        `prev_chunk` still holds the previous tick's chunk while act's inputs are staged)."""
        chunk = self.dims["chunk"]
        rows = self._rtc_rows + b["rtc_shift"]
        keep = (rows < chunk)[:, None]
        return (b["prev_chunk"][rows.clamp(max=chunk - 1)] * keep)[None]

    def _rtc_into(self, engine, b) -> None:
        """The fused engine's RTC buffers from this tick's shift and weights (graph-capturable: no host reads)."""
        w = b["rtc_weights"][None]
        engine.buffers.rtc_prev.copy_(self._rtc_prev(b))
        engine.buffers.rtc_a.copy_(self._rtc_dt + self._rtc_ca[:, None] * w)
        engine.buffers.rtc_b.copy_(self._rtc_cb[:, None] * w)

    def _rtc_inputs(self, b):
        """The reference engines' RTC argument for this tick (None with RTC off)."""
        if self.rtc is None:
            return None
        return rtc.RTCInputs(prev=self._rtc_prev(b), weights=b["rtc_weights"],
                             max_guidance_weight=self.rtc.options.max_guidance_weight)

    def _state_offset(self, raw_state: torch.Tensor) -> torch.Tensor:
        """What the absolute-actions step adds to this observation's actions (zeros without relative actions)."""
        if self._offset_mask is None:
            return torch.zeros(self.dims["action_dim"])
        return raw_state[: self.dims["action_dim"]].float() * self._offset_mask

    def _robot_actions(self, chunk: torch.Tensor, b) -> torch.Tensor:
        """Model-space chunk [chunk, max_action_dim] -> robot units [chunk, action_dim] (post-processor)."""
        return self._action_norm.unnormalize_actions(chunk[:, :self.dims["action_dim"]]) + b["action_offset"]

    def device_part(self, stage):
        if hasattr(self.policy.engine, "run_stage"):  # the fused engine: a stage and its copies in one graph
            return {"observe": self._observe_in_engine, "act": self._act_in_engine}.get(stage)
        return {"observe": self._observe, "act": self._act}.get(stage)

    def device_plan(self, stages):
        # (the overlapped decision graph runs the plain act stage: with RTC the stages run one after the other)
        if list(stages) == ["observe", "act"] and hasattr(self.policy.engine, "run_decision") and self.rtc is None:
            return self._decision_in_engine
        return None

    def attach_buffers(self, b) -> None:
        """The runtime's persistent prefix buffers become the fused engine's own (`share_prefix`): observe
        writes the prefix K/V, pad mask and valid count straight into the contract's buffers and act reads
        them there, so no tick copies a prefix (~10 MB at full size) and a capsule restore is what the engine
        reads next. (The reference engine takes the prefix as an argument: nothing to attach.)"""
        engine = self.policy.engine
        if hasattr(engine, "share_prefix"):
            engine.share_prefix(prefix_cache(b))

    def _observe_hooks(self, b):
        """(pre, post) of the `observe` device part in the engine: frames -> SigLIP input and prompt tokens ->
        engine buffers; then the prefix out into the contract's buffers."""
        engine, c = self.policy.engine, self.config

        def pre():
            images, masks = device_images(b["images"], b["image_mask"], c.num_image_slots, self.image_size,
                                          self.IMAGE_PAD)
            engine.set_observation(*self.observation(b, images, masks))

        def post():
            buf = engine.buffers
            if buf.prefix_k.data_ptr() != b["prefix_k"].data_ptr():  # (not shared: attach_buffers was not called)
                b["prefix_k"].copy_(buf.prefix_k[:, 0])
                b["prefix_v"].copy_(buf.prefix_v[:, 0])
                b["prefix_mask"].copy_(buf.pad_mask[0])
                b["prefix_valid"].copy_(buf.n_valid)
            self._after_observe(b)
        return pre, post

    def _after_observe(self, b) -> None:
        """What the observe stage does besides the prefix (pi0.5: this observation's absolute-actions offset)."""
        b["action_offset"].copy_(b["state_offset"])

    def _act_inputs(self, engine, b) -> None:
        """The act stage's inputs besides the prefix into the engine's buffers (pi0.5: the noise, and RTC's)."""
        engine.buffers.noise.copy_(b["noise"][None])
        if self.rtc is not None:
            self._rtc_into(engine, b)

    def _act_hooks(self, b, prefix: bool = True):
        """(pre, post) of the `act` device part in the engine: the prefix (unless the engine's buffers already
        hold it) and the noise in; then the chunk out (model space into prev_chunk, robot units into actions)."""
        engine = self.policy.engine

        def pre():
            if prefix:
                engine.set_prefix(prefix_cache(b))
            self._act_inputs(engine, b)

        def post():
            chunk = engine.buffers.actions[0]
            b["prev_chunk"].copy_(chunk)
            b["actions"].copy_(self._robot_actions(chunk, b))
        return pre, post

    def _observe_in_engine(self, b) -> None:
        """The `observe` device part inside the engine's CUDA graph (with its copies: one graph launch)."""
        self.policy.engine.run_stage("observe", *self._observe_hooks(b), key="contract")

    def _act_in_engine(self, b) -> None:
        """The `act` device part inside the engine's CUDA graph (with its copies: one graph launch; with RTC,
        the guided graph)."""
        self.policy.engine.run_stage("act" if self.rtc is None else "act+rtc", *self._act_hooks(b), key="contract")

    def _decision_in_engine(self, b) -> None:
        """`observe` then `act` in one tick (contract graphs: plan) as one engine decision graph: act reads the
        prefix observe just wrote into the engine's buffers (the same values observe copies out), so its first
        flow step runs beside the observe stage."""
        from flashrt_core.engine.staged import DecisionHooks

        (observe_pre, observe_post), (act_pre, act_post) = self._observe_hooks(b), self._act_hooks(b, prefix=False)
        self.policy.engine.run_decision(DecisionHooks(observe_pre, observe_post, act_pre, act_post), key="contract")

    def _prefix_into(self, b) -> None:
        """The camera frames and tokens of `b` -> the prefix K/V into its persistent buffers."""
        images, masks = device_images(b["images"], b["image_mask"], self.config.num_image_slots, self.image_size,
                                      self.IMAGE_PAD)
        cache = self.policy.engine.encode_prefix(*self.observation(b, images, masks))
        b["prefix_k"].copy_(cache.k[:, 0])
        b["prefix_v"].copy_(cache.v[:, 0])
        b["prefix_mask"].copy_(cache.pad_mask[0])
        b["prefix_valid"].copy_(cache.n_valid)

    def _observe(self, b) -> None:
        self._prefix_into(b)
        self._after_observe(b)

    def _act(self, b) -> None:
        cache = prefix_cache(b)
        chunk = self.policy.denoise(cache, b["noise"][None], rtc=self._rtc_inputs(b))[0]
        b["prev_chunk"].copy_(chunk)  # model space: what the next chunk would be conditioned on
        b["actions"].copy_(self._robot_actions(chunk, b))

    def debug_graphs(self, on: bool) -> None:
        self.policy.engine.debug_graphs = on

    def identity(self) -> str:
        """Architecture, sizes and weight precision (a capsule of another precision does not restore here)."""
        ran = self.policy.engine.precision_report["precision"]  # (after a fallback: what runs, not what was asked)
        to_json = getattr(self.config, "to_json", None)  # (a model's own form keeps its capsules' fingerprints)
        sizes = (to_json().replace("\n", "").replace(" ", "") if to_json is not None
                 else json.dumps(dataclasses.asdict(self.config), sort_keys=True, separators=(",", ":")))
        return f"{self.name}:{ran}:" + sizes

    def weights(self):
        return list(named_tensors(self.policy.weights, "w"))


def rtc_writes(d) -> dict:
    """RTC's per-tick buffers that act writes (both models; staged only with RTC on)."""
    return {"rtc_weights": ((d["chunk"],), "float32"), "rtc_shift": ((1,), "int64"),
            "rtc_clock": ((2,), "int64")}


def prefix_signature(d, model) -> dict:
    """The persistent prefix buffers observe writes and act reads (both models)."""
    kv = ((d["layers"], d["kv_heads"], d["prefix_len"], d["head_dim"]), model.dtype)
    return {"prefix_k": kv, "prefix_v": kv, "prefix_mask": ((d["prefix_len"],), "bool"),
            "prefix_valid": ((1,), "int64")}


def prompt_signature(d) -> StageSignature:
    return StageSignature(reads={"prompt": ((d["prompt_bytes"],), "uint8")},
                          writes={"task": ((d["prompt_bytes"],), "uint8")})


def observe_reads(d) -> dict:
    """The task and the camera frames (every model's observe reads them)."""
    return {"task": ((d["prompt_bytes"],), "uint8"),
            "images": ((d["views"], d["image_height"], d["image_width"], 3), "uint8"),
            "image_mask": ((d["views"],), "bool")}


def token_writes(d) -> dict:
    return {"lang_tokens": ((d["prompt_len"],), "int64"), "lang_mask": ((d["prompt_len"],), "bool")}


@dataclasses.dataclass
class PrefixCache:
    """The persistent prefix buffers as every engine's prefix cache reads them (fields k, v, pad_mask, n_valid:
    per layer K/V [layers, B, kv_heads, prefix_len, head_dim], the real tokens, their count)."""

    k: torch.Tensor
    v: torch.Tensor
    pad_mask: torch.Tensor
    n_valid: torch.Tensor


def prefix_cache(b) -> PrefixCache:
    """The persistent prefix buffers viewed as a prefix cache (batch 1, no copies)."""
    return PrefixCache(k=b["prefix_k"][:, None], v=b["prefix_v"][:, None], pad_mask=b["prefix_mask"][None],
                       n_valid=b["prefix_valid"])


def device_images(frames: torch.Tensor, present: torch.Tensor, slots: int, size: int, pad: str = "centre"):
    """uint8 frames [views, H, W, 3] + present [views] bool (on device) -> SigLIP input [slots, 3, size, size]
    in [-1, 1] and masks [slots], as `lerobot.preprocess.preprocess_images` builds them (present cameras first,
    missing ones
    as -1 images with mask False), without reading the mask on the host."""
    x = frames.permute(0, 3, 1, 2).float() / 255.0
    if tuple(x.shape[-2:]) != (size, size):
        x = resize_with_pad(x, size, size, pad)
    x = torch.where(present[:, None, None, None], x * 2.0 - 1.0, -1.0)
    p = present.long()
    n_present = p.sum()
    dest = torch.where(present, torch.cumsum(p, 0) - 1, n_present + torch.cumsum(1 - p, 0) - 1)
    images = torch.full((slots, 3, size, size), -1.0, device=frames.device)
    images.index_copy_(0, dest, x)
    masks = torch.arange(slots, device=frames.device) < n_present
    return images, masks


def named_tensors(value, name: str):
    """(name, tensor) of every weight, for the weights digest; the tables derived from the others (the AdaRMS
    modulation per step: CPU matmuls, whose last bits depend on the thread count) are left out, so that the
    same weights give the same digest in every process."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from named_tensors(v, f"{name}.{i}")
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            if f.name != "config" and f.name not in getattr(value, "TABLE_FIELDS", ()):
                yield from named_tensors(getattr(value, f.name), f"{name}.{f.name}")

