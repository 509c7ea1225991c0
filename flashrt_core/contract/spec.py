"""The execution contract as validated, frozen data.

A contract (YAML under `config/`) names the buffers a policy keeps, the stages that read and write them, and
when each stage runs. Symbolic dims (`[chunk, action_dim]`) and the `model` dtype are resolved from the model
binding, which also declares what each of its stages reads and writes, so a contract that disagrees with the
model is rejected at load, not at the first tick. Every ContractError names the field path
(`stages.act.trigger.rate_hz`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from flashrt_core.errors import ContractError

DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
LIFETIMES = ("persistent", "transient", "input")
PLACES = ("device", "host")
GRAPH_MODES = ("stage", "plan", "off")
LATE_POLICIES = ("reuse", "wait")

_TOP_KEYS = {"version", "model", "limits", "buffers", "stages", "output", "graphs", "description"}
_MODEL_KEYS = {"name", "checkpoint", "dtype", "options"}
_LIMIT_KEYS = {"max_observation_age_ms", "late_observe"}
_BUFFER_KEYS = {"shape", "dtype", "lifetime", "place", "doc"}
_STAGE_KEYS = {"reads", "writes", "trigger", "deferred", "doc"}
MIN_RATE_HZ, MAX_RATE_HZ = 1e-3, 1e4  # a stage's rate: at least once per 1000 s, at most every 0.1 ms
_TRIGGER_KEYS = {"rate_hz", "on_change", "after"}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    checkpoint: str | None = None  # None: the binding's built-in tiny random model
    dtype: str = "float32"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Limits:
    max_observation_age_ms: float | None = None  # None: never refuse for age
    late_observe: str = "reuse"  # reuse the last outputs, or wait for fresh inputs


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: tuple[int, ...]  # resolved
    dtype: str  # resolved (never "model")
    lifetime: str  # persistent (survives decisions, goes into capsules) | transient | input
    place: str = "device"  # host buffers stay in CPU memory (text, values only host code reads)
    declared_shape: tuple = ()  # as written, e.g. ("chunk", "action_dim")

    @property
    def persistent(self) -> bool:
        return self.lifetime == "persistent"

    @property
    def is_input(self) -> bool:
        return self.lifetime == "input"


@dataclass(frozen=True)
class Trigger:
    rate_hz: float | None = None
    on_change: str | None = None  # may be combined with rate_hz: periodic, and at once when this buffer changes
    after: str | None = None

    def describe(self) -> str:
        parts = []
        if self.rate_hz is not None:
            parts.append(f"{self.rate_hz:g} Hz")
        if self.on_change is not None:
            parts.append(f"on change of {self.on_change}")
        if self.after is not None:
            parts.append(f"after {self.after}")
        return " + ".join(parts)


@dataclass(frozen=True)
class StageSpec:
    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    trigger: Trigger
    # Run after the tick's other stages, off its critical path: stages that read its outputs use them from
    # the next tick on (a slow stage pipelined behind the fast output stage).
    deferred: bool = False

    def describe_trigger(self) -> str:
        """When the stage runs, for summaries and reports: its trigger, and whether it is deferred."""
        return self.trigger.describe() + (" (deferred)" if self.deferred else "")


@dataclass(frozen=True)
class StageSignature:
    """What a model stage really reads and writes: buffer name -> (shape, dtype)."""

    reads: Mapping[str, tuple[tuple[int, ...], str]]
    writes: Mapping[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True)
class Contract:
    model: ModelSpec
    limits: Limits
    buffers: Mapping[str, BufferSpec]
    stages: Mapping[str, StageSpec]  # in DAG (execution) order
    output: str  # the buffer a step returns as its actions
    graphs: str  # CUDA graph granularity: per stage, per plan of stages, or none
    dims: Mapping[str, int]
    raw: Mapping[str, Any]  # the validated source dict, for re-validation with overrides
    source: str | None = None

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.stages)

    def producer(self, buffer: str) -> str | None:
        for s in self.stages.values():
            if buffer in s.writes:
                return s.name
        return None

    def output_stage(self) -> str:
        return self.producer(self.output)

    def upstream(self, stage: str) -> set[str]:
        """Every stage whose outputs `stage` reads, transitively (not `after` parents)."""
        seen, todo = set(), [stage]
        while todo:
            for b in self.stages[todo.pop()].reads:
                p = self.producer(b)
                if p is not None and p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def with_overrides(self, *, checkpoint: Any = ..., dtype: Any = ..., rates: Mapping | None = None,
                       limits: Mapping | None = None, options: Mapping | None = None,
                       deferred: Mapping[str, bool] | None = None, binding=None) -> "Contract":
        """A re-validated copy with the model, rates, limits or deferred stages changed (e.g. from ROS
        parameters)."""
        data = overridden(self.raw, checkpoint=checkpoint, dtype=dtype, rates=rates, limits=limits,
                          options=options, deferred=deferred)
        return validate(data, binding=binding, source=self.source)

    def summary(self) -> str:
        weights = self.model.checkpoint or "no checkpoint: built-in random weights"
        lines = [f"model {self.model.name} ({weights}, {self.model.dtype}); "
                 f"output {self.output}; graphs {self.graphs}"]
        for s in self.stages.values():
            lines.append(f"  stage {s.name}: {s.describe_trigger()}; reads {', '.join(s.reads) or '-'}; "
                         f"writes {', '.join(s.writes)}")
        for b in self.buffers.values():
            lines.append(f"  buffer {b.name}: {list(b.shape)} {b.dtype} {b.lifetime}"
                         + (" (host)" if b.place == "host" else ""))
        age = self.limits.max_observation_age_ms
        lines.append(f"  limits: max_observation_age_ms {age if age is not None else 'none'}, "
                     f"late_observe {self.limits.late_observe}")
        return "\n".join(lines)


# ---- loading -------------------------------------------------------------------------------------------
def auto_dtype(device) -> str:
    """`dtype: auto`: bfloat16 on CUDA, float32 elsewhere (device None: this machine's CUDA if any)."""
    import torch

    if device is None:
        return "bfloat16" if torch.cuda.is_available() else "float32"
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def overridden(raw: Mapping, *, checkpoint: Any = ..., dtype: Any = ..., rates: Mapping | None = None,
               limits: Mapping | None = None, options: Mapping | None = None,
               deferred: Mapping[str, bool] | None = None) -> dict:
    """A copy of a contract's source dict with the model, rates, limits or deferred stages changed."""
    if not isinstance(raw, Mapping):
        raise ContractError(f"contract: expected a mapping at the top level, got {type(raw).__name__}")
    data = _deep_copy(raw)
    model = data.setdefault("model", {})
    if not isinstance(model, dict):
        return data  # (validate names the malformed section)
    if checkpoint is not ...:
        model["checkpoint"] = checkpoint
    if dtype is not ... and dtype is not None:
        model["dtype"] = dtype
    if options:
        model.setdefault("options", {}).update(options)

    def stage_of(stage, what):
        if stage not in data.get("stages", {}):
            raise ContractError(f"stages.{stage}: unknown stage in {what} override "
                                f"(stages: {', '.join(data.get('stages', {}))})")
        return data["stages"][stage]

    for stage, rate in (rates or {}).items():
        stage_of(stage, "rate").setdefault("trigger", {})["rate_hz"] = rate
    for stage, flag in (deferred or {}).items():
        stage_of(stage, "deferred")["deferred"] = flag
    if limits:
        data.setdefault("limits", {}).update(limits)
    return data


def configured_contract(path, checkpoint=None, dtype=None, *, rates: Mapping[str, float] | None = None,
                        max_observation_age_ms: float | None = None, num_cameras: int | None = None,
                        limits: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                        deferred: Mapping[str, bool] | None = None, binding=None, device=None) -> Contract:
    """A contract file with overrides applied (e.g. ROS parameters), validated as a whole: `rates` {stage: hz},
    `max_observation_age_ms`, `limits`, `options` (model options; `num_cameras` is options["views"]) and
    `deferred` {stage: bool}; `device` resolves `dtype: auto` for that device. The overrides apply to the
    file's data before it is validated (a contract may leave its checkpoint to them)."""
    data = read_contract_data(path)
    model = data.get("model") if isinstance(data, Mapping) else None
    if dtype is None and device is not None and isinstance(model, Mapping) and model.get("dtype") == "auto":
        dtype = auto_dtype(device)
    limits = dict(limits or {})
    if max_observation_age_ms is not None:
        limits["max_observation_age_ms"] = max_observation_age_ms
    options = dict(options or {})
    if num_cameras is not None:
        options["views"] = num_cameras
    data = overridden(data, checkpoint=checkpoint if checkpoint is not None else ..., dtype=dtype_name(dtype),
                      rates=rates, limits=limits, options=options, deferred=deferred)
    return validate(data, binding=binding, source=str(path))


def dtype_name(dtype) -> str | None:
    """A contract dtype name for a torch dtype or an alias (bf16, fp32, ...)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
            "float": "float32"}.get(name, name)


def load_contract(path, binding=None) -> Contract:
    return validate(read_contract_data(path), binding=binding, source=str(path))


def read_contract_data(path):
    """A contract file's YAML (keys given twice refused), not validated yet."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ContractError(f"{path}: cannot read contract ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ContractError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ContractError(f"{path}: not valid YAML: {e}") from None
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error: plain YAML keeps the last
    one silently, which would drop a stage, a buffer or a limit the user wrote."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key (a list or mapping): the base class reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first on line {first})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def validate(data: Any, binding=None, source: str | None = None) -> Contract:
    """Check a contract dict and resolve it against its model binding; raise ContractError naming the field."""
    if not isinstance(data, Mapping):
        raise ContractError(f"contract: expected a mapping at the top level, got {type(data).__name__}")
    _no_unknown(data, _TOP_KEYS, "")
    version = data.get("version", 1)
    if version != 1 or isinstance(version, bool):
        raise ContractError(f"version: this flashrt reads contract version 1, got {version!r}")
    model = _model(data.get("model"))
    if binding is None:
        from flashrt_core.contract.bindings import resolve_binding

        binding = resolve_binding(model.name)
    limits = _limits(data.get("limits", {}))
    graphs = data.get("graphs", "stage")
    if graphs not in GRAPH_MODES:
        raise ContractError(f"graphs: must be one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
    dims = dict(binding.dims(model))
    buffers = _buffers(_mapping(data.get("buffers"), "buffers"), dims, model.dtype)
    stages = _stages(_mapping(data.get("stages"), "stages"), buffers)
    _check_producers(buffers, stages)
    order = _topological_order(stages, buffers)
    output = data.get("output")
    if not isinstance(output, str) or not output:
        raise ContractError("output: missing; name the buffer a step returns as its actions")
    if output not in buffers:
        raise ContractError(f"output: unknown buffer {output!r}")
    if not any(output in s.writes for s in stages.values()):
        raise ContractError(f"output: buffer {output!r} is not written by any stage")
    out_stage = next(s for s in stages.values() if output in s.writes)
    if out_stage.deferred:
        raise ContractError(f"stages.{out_stage.name}.deferred: the stage writing the output ({output}) cannot be "
                            "deferred (deferral takes a stage off the output's critical path)")
    parent, seen = out_stage.trigger.after, set()
    while parent is not None and parent in stages and parent not in seen:  # an `after` chain runs with its head
        seen.add(parent)
        if stages[parent].deferred:
            raise ContractError(f"stages.{out_stage.name}.trigger.after: the stage writing the output ({output}) "
                                f"cannot run after the deferred stage {parent} (it would be deferred too)")
        parent = stages[parent].trigger.after
    _check_signatures(binding, stages, buffers, dims, model)
    ordered = {name: stages[name] for name in order}
    return Contract(model=model, limits=limits, buffers=buffers, stages=ordered, output=output, graphs=graphs,
                    dims=dims, raw=_deep_copy(dict(data)), source=source)


# ---- sections --------------------------------------------------------------------------------------------
def _model(m) -> ModelSpec:
    m = _mapping(m, "model")
    _no_unknown(m, _MODEL_KEYS, "model")
    name = m.get("name")
    if not isinstance(name, str) or not name:
        raise ContractError("model.name: missing (e.g. pi05)")
    ckpt = m.get("checkpoint")
    if ckpt is not None and (not isinstance(ckpt, str)):
        raise ContractError(f"model.checkpoint: expected a path or null, got {ckpt!r}")
    dtype = m.get("dtype", "float32")
    if dtype == "auto":
        dtype = auto_dtype(None)
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ContractError(f"model.dtype: must be auto, float32, float16 or bfloat16, got {dtype!r}")
    options = m.get("options", {}) or {}
    if not isinstance(options, Mapping):
        raise ContractError("model.options: expected a mapping")
    return ModelSpec(name=name, checkpoint=ckpt or None, dtype=dtype, options=dict(options))


def _limits(lim) -> Limits:
    lim = _mapping(lim, "limits")
    _no_unknown(lim, _LIMIT_KEYS, "limits")
    age = lim.get("max_observation_age_ms")
    if age is not None and (not _is_number(age) or not age > 0):
        raise ContractError(f"limits.max_observation_age_ms: must be a positive number or null, got {age!r}")
    late = lim.get("late_observe", "reuse")
    if late not in LATE_POLICIES:
        raise ContractError(f"limits.late_observe: must be reuse or wait, got {late!r}")
    return Limits(max_observation_age_ms=float(age) if age is not None else None, late_observe=late)


def _buffers(raw: Mapping, dims: Mapping[str, int], model_dtype: str) -> dict[str, BufferSpec]:
    if not raw:
        raise ContractError("buffers: at least one buffer is required")
    out = {}
    for name, b in raw.items():
        path = f"buffers.{name}"
        b = _mapping(b, path)
        _no_unknown(b, _BUFFER_KEYS, path)
        shape = b.get("shape")
        if not isinstance(shape, (list, tuple)):
            raise ContractError(f"{path}.shape: missing or not a list, got {shape!r}")
        resolved = []
        for i, d in enumerate(shape):
            if isinstance(d, bool) or not isinstance(d, (int, str)):
                raise ContractError(f"{path}.shape[{i}]: expected an int or a dim name, got {d!r}")
            if isinstance(d, str):
                if d not in dims:
                    raise ContractError(f"{path}.shape[{i}]: unknown dim {d!r} "
                                        f"(the model defines: {', '.join(sorted(dims))})")
                d = dims[d]
            if d <= 0:
                raise ContractError(f"{path}.shape[{i}]: must be positive, got {d}")
            resolved.append(int(d))
        dtype = b.get("dtype")
        if dtype == "model":
            dtype = model_dtype
        if dtype not in DTYPES:
            raise ContractError(f"{path}.dtype: must be one of model, {', '.join(DTYPES)}; got {b.get('dtype')!r}")
        lifetime = b.get("lifetime")
        if lifetime not in LIFETIMES:
            raise ContractError(f"{path}.lifetime: must be one of {', '.join(LIFETIMES)}, got {lifetime!r}")
        place = b.get("place", "device")
        if place not in PLACES:
            raise ContractError(f"{path}.place: must be device or host, got {place!r}")
        out[name] = BufferSpec(name, tuple(resolved), dtype, lifetime, place, tuple(shape))
    return out


def _stages(raw: Mapping, buffers: Mapping[str, BufferSpec]) -> dict[str, StageSpec]:
    if not raw:
        raise ContractError("stages: at least one stage is required")
    out = {}
    for name, s in raw.items():
        path = f"stages.{name}"
        s = _mapping(s, path)
        _no_unknown(s, _STAGE_KEYS, path)
        reads = _names(s.get("reads", []), f"{path}.reads", buffers)
        writes = _names(s.get("writes"), f"{path}.writes", buffers)
        if not writes:
            raise ContractError(f"{path}.writes: a stage must write at least one buffer")
        both = set(reads) & set(writes)
        if both:
            raise ContractError(f"{path}.writes: {sorted(both)[0]!r} is also in reads (a stage may not read "
                                "what it writes; keep the previous value in a separate persistent buffer)")
        deferred = s.get("deferred", False)
        if not isinstance(deferred, bool):
            raise ContractError(f"{path}.deferred: must be true or false, got {deferred!r}")
        out[name] = StageSpec(name, reads, writes, _trigger(s.get("trigger"), f"{path}.trigger", reads, raw),
                              deferred=deferred)
    return out


def _trigger(t, path: str, reads: tuple[str, ...], stages: Mapping) -> Trigger:
    if t is None:
        raise ContractError(f"{path}: missing (rate_hz, on_change or after)")
    t = _mapping(t, path)
    _no_unknown(t, _TRIGGER_KEYS, path)
    if not t:
        raise ContractError(f"{path}: needs one of rate_hz, on_change, after")
    rate, change, after = t.get("rate_hz"), t.get("on_change"), t.get("after")
    if "rate_hz" in t and (not _is_number(rate) or not math.isfinite(rate) or rate <= 0):
        raise ContractError(f"{path}.rate_hz: must be a positive number, got {rate!r}")
    if "rate_hz" in t and not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:
        raise ContractError(f"{path}.rate_hz: must be between {MIN_RATE_HZ:g} and {MAX_RATE_HZ:g} Hz, got {rate!r}")
    if "after" in t:
        if not isinstance(after, str):
            raise ContractError(f"{path}.after: expected a stage name, got {after!r}")
        if len(t) > 1:
            raise ContractError(f"{path}.after: cannot be combined with {', '.join(k for k in t if k != 'after')}")
        if after not in stages:
            raise ContractError(f"{path}.after: unknown stage {after!r}")
        if after == path.split(".")[1]:
            raise ContractError(f"{path}.after: a stage cannot run after itself")
    if "on_change" in t:
        if not isinstance(change, str) or change not in reads:
            raise ContractError(f"{path}.on_change: {change!r} must be one of the stage's reads "
                                f"({', '.join(reads) or 'none'})")
    return Trigger(rate_hz=float(rate) if rate is not None else None, on_change=change, after=after)


def _check_producers(buffers, stages) -> None:
    producer: dict[str, str] = {}
    for s in stages.values():
        for b in s.writes:
            if buffers[b].is_input:
                raise ContractError(f"stages.{s.name}.writes: {b!r} is an input (set by set_observation/"
                                    "set_prompt); it cannot also be written by a stage")
            if b in producer:
                raise ContractError(f"stages.{s.name}.writes: buffer {b!r} is already written by stage "
                                    f"{producer[b]!r} (one producer per buffer)")
            producer[b] = s.name
    for s in stages.values():
        for b in s.reads:
            if not buffers[b].is_input and b not in producer:
                raise ContractError(f"stages.{s.name}.reads: buffer {b!r} is never produced "
                                    "(no stage writes it and it is not an input)")
    for b in buffers.values():
        if not b.is_input and b.name not in producer:
            raise ContractError(f"buffers.{b.name}: never produced (no stage writes it and it is not an input)")
    read = {b for s in stages.values() for b in s.reads}
    for b in buffers.values():
        if b.is_input and b.name not in read:  # (a runtime would wait for it forever: has_observation)
            raise ContractError(f"buffers.{b.name}: an input that no stage reads (remove it, or add it to the "
                                "reads of the stage that uses it)")


def _topological_order(stages, buffers) -> list[str]:
    """Stable DAG order (declaration order among independent stages); a cycle names its stages."""
    producer = {b: s.name for s in stages.values() for b in s.writes}
    deps = {n: [] for n in stages}
    for s in stages.values():
        for b in s.reads:
            if b in producer:
                deps[s.name].append(producer[b])
        if s.trigger.after:
            deps[s.name].append(s.trigger.after)
    order, state = [], {}

    def visit(n, stack):
        if state.get(n) == "done":
            return
        if state.get(n) == "active":
            cycle = (stack[stack.index(n):] + [n])[::-1]  # the stack runs against the data flow
            raise ContractError(f"stages: cycle {' -> '.join(cycle)} (through their reads/writes/after)")
        state[n] = "active"
        for d in deps[n]:
            visit(d, stack + [n])
        state[n] = "done"
        order.append(n)

    for n in stages:
        visit(n, [])
    return order


def _check_signatures(binding, stages, buffers, dims, model: ModelSpec) -> None:
    sigs = binding.signatures(dims, model)
    for s in stages.values():
        path = f"stages.{s.name}"
        sig = sigs.get(s.name)
        if sig is None:
            raise ContractError(f"{path}: model {model.name} has no stage {s.name!r} "
                                f"(it has: {', '.join(sigs)})")
        for kind, declared, actual in (("reads", s.reads, sig.reads), ("writes", s.writes, sig.writes)):
            for b in declared:
                if b not in actual:
                    raise ContractError(f"{path}.{kind}: model {model.name} stage {s.name} does not {kind[:-1]} "
                                        f"{b!r} (it {kind}: {', '.join(actual) or 'nothing'})")
                shape, dtype = actual[b]
                buf = buffers[b]
                if tuple(shape) != buf.shape:
                    raise ContractError(f"buffers.{b}.shape: {list(buf.shape)} (from {list(buf.declared_shape)}) "
                                        f"but model {model.name} stage {s.name} {kind} {list(shape)}")
                if dtype != buf.dtype:
                    raise ContractError(f"buffers.{b}.dtype: {buf.dtype} but model {model.name} stage {s.name} "
                                        f"{kind} {dtype}")
            missing = [b for b in actual if b not in declared]
            if missing:
                raise ContractError(f"{path}.{kind}: missing {missing[0]!r}, which model {model.name} stage "
                                    f"{s.name} {kind}")


# ---- helpers ---------------------------------------------------------------------------------------------
def _mapping(v, path: str) -> Mapping:
    if v is None:
        raise ContractError(f"{path}: missing")
    if not isinstance(v, Mapping):
        raise ContractError(f"{path}: expected a mapping, got {type(v).__name__}")
    return v


def _names(v, path: str, buffers) -> tuple[str, ...]:
    if v is None:
        raise ContractError(f"{path}: missing")
    if not isinstance(v, (list, tuple)):
        raise ContractError(f"{path}: expected a list of buffer names, got {v!r}")
    for i, n in enumerate(v):
        if not isinstance(n, str):
            raise ContractError(f"{path}[{i}]: expected a buffer name, got {n!r}")
        if n not in buffers:
            raise ContractError(f"{path}[{i}]: unknown buffer {n!r}")
    if len(set(v)) != len(v):
        raise ContractError(f"{path}: lists a buffer twice")
    return tuple(v)


def _no_unknown(m: Mapping, known: set, path: str) -> None:
    for k in m:
        if k not in known:
            where = f"{path}.{k}" if path else str(k)
            raise ContractError(f"{where}: unknown key (expected one of {', '.join(sorted(known))})")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _deep_copy(v):
    if isinstance(v, Mapping):
        return {k: _deep_copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_deep_copy(x) for x in v]
    return v
