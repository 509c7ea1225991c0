"""The engine's tuned launch choices, kept on disk so that a restarted engine does not time them again.

The GEMM and attention pickers time every candidate per shape during the first warm-up: on an H200 that is
two minutes of Triton compiles and timings before a policy node can act (`Runtime.warmup()` measured 126 s).
The choices only depend on the GPU, the software and the kernels' source, so they are written to one JSON
file per such context and read back by the next engine: it compiles the chosen kernels only.

    directory: $FLASHRT_TUNING_CACHE if set ("off" disables it), else $XDG_CACHE_HOME/flashrt/tuning
               (~/.cache/flashrt/tuning)
    file:      <context id>.json = {"format": 1, "context": {...},
                                    "choices": {picker: {shape key: {"choice": ..., "ms": {candidate: ms}}}}}

The context is the GPU name and compute capability, torch, Triton and CUDA versions, and a hash of the
source of the kernels whose launch parameters are chosen: any change there is a new file, never a stale
choice. A cached choice is still checked against the reference result once before it is used (the pickers
do that), and an unreadable or malformed file is ignored with a warning and rewritten: a cache can cost
time, never correctness.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FORMAT = 1
ENV = "FLASHRT_TUNING_CACHE"
# What a cached choice depends on besides the hardware and software versions: the kernels whose launch
# parameters are chosen (and the launch / PDL / ticket code they share), and the pickers' candidate tables
# and their meaning (a new candidate must get its chance). Never the benchmarks: editing a comparison must
# not make every robot tune again.
_SOURCES = ("flashrt_core/kernels/skinny_gemm.py", "flashrt_core/kernels/flash_attention.py",
            "flashrt_core/kernels/_tickets.py", "flashrt_core/kernels/_pdl.py", "flashrt_core/kernels/_common.py",
            "flashrt_core/engine/gemm.py", "flashrt_core/engine/attention.py")


def default_directory() -> Path | None:
    """Where the engine keeps its choices by default; None when $FLASHRT_TUNING_CACHE is "off"."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("off", "0", "none", "") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashrt" / "tuning"


def sources_hash(sources=_SOURCES) -> str:
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for rel in sources:
        digest.update(rel.encode())
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def gpu_context(device, **extra) -> dict:
    """What a tuned choice depends on, for a CUDA device (plus `extra`: engine settings such as pdl)."""
    import triton  # the pickers only tune where Triton runs

    device = torch.device(device)
    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "kernels": sources_hash(), **extra}


def encode_key(key) -> str:
    """A picker's shape key (nested tuples of ints, bools, None and dtypes) as a stable string."""
    def plain(v):
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, torch.dtype):
            return str(v)
        return v
    return json.dumps(plain(key), separators=(",", ":"))


class TuningCache:
    """Choices per picker ("linear", "attention") and shape key, loaded from and saved to one JSON file.
    A choice is None (the library path: cuBLAS, the attention heuristic) or a tuple of launch parameters;
    each is kept with the candidates' times that decided it (benchmarks report them)."""

    def __init__(self, path: str | Path | None, context: dict):
        self.path = None if path is None else Path(path)
        self.context = dict(context)
        self.choices: dict[str, dict[str, tuple[object, dict]]] = {}  # picker -> key -> (choice, ms)
        self.loaded_from_disk = 0  # entries read from the file (benchmarks and tests report it)
        self._dirty = False
        if self.path is not None:
            self._load()

    @classmethod
    def for_device(cls, device, directory: str | Path | None = "default", **extra) -> TuningCache | None:
        """The cache of a CUDA device in `directory` ("default": `default_directory()`; None or False: off),
        for engines with the settings `extra` (they are part of the context); None when off or not on CUDA."""
        device = torch.device(device)
        if device.type != "cuda" or directory is None or directory is False:
            return None
        directory = default_directory() if directory == "default" else directory
        if directory is None:
            return None
        try:
            context = gpu_context(device, **extra)
        except (ImportError, RuntimeError, OSError) as exc:  # no Triton, or the GPU cannot be queried
            log.warning("tuning cache off: %s", exc)
            return None
        ident = hashlib.sha256(json.dumps(context, sort_keys=True).encode()).hexdigest()[:20]
        return cls(Path(directory) / f"{ident}.json", context)

    def _load(self) -> None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("tuning cache %s: cannot read it (%s); tuning again", self.path, exc)
            return
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                found = data.get("format") if isinstance(data, dict) else type(data).__name__
                raise ValueError(f"format {found!r}, expected {FORMAT}")
            if data.get("context") != self.context:
                raise ValueError("it was written for another GPU or software context")
            choices = data.get("choices")
            if not isinstance(choices, dict) or not all(isinstance(v, dict) for v in choices.values()):
                raise ValueError("`choices` is not a mapping of pickers to shape keys")
            self.choices = {picker: {k: _decode_entry(v) for k, v in entries.items()}
                            for picker, entries in choices.items()}
        except (ValueError, TypeError) as exc:
            log.warning("tuning cache %s is ignored (%s); tuning again and rewriting it", self.path, exc)
            self.choices = {}
            self._dirty = True
            return
        self.loaded_from_disk = sum(len(v) for v in self.choices.values())

    def get(self, picker: str, key) -> tuple[bool, object, dict]:
        """(found, choice, candidate times in ms) for a picker's shape key."""
        entry = self.choices.get(picker, {}).get(encode_key(key))
        return (False, None, {}) if entry is None else (True, entry[0], dict(entry[1]))

    def put(self, picker: str, key, choice, ms: dict | None = None) -> None:
        entries = self.choices.setdefault(picker, {})
        entry = (None if choice is None else tuple(choice), dict(ms or {}))
        k = encode_key(key)
        if entries.get(k) != entry:
            entries[k] = entry
            self._dirty = True

    def forget(self, picker: str, key) -> None:
        """Drop a choice that no longer checks out (the picker tunes that shape again)."""
        if self.choices.get(picker, {}).pop(encode_key(key), None) is not None:
            self._dirty = True

    def save(self) -> bool:
        """Write the file if anything changed (atomically: a reader never sees half a file), keeping the entries
        another engine wrote since this one read it (this one's win where both have a key). A directory that
        cannot be written is reported and left alone. Returns whether a file was written."""
        if self.path is None or not self._dirty:
            return False
        on_disk = TuningCache(self.path, self.context).choices if self.path.exists() else {}
        for picker, entries in self.choices.items():
            on_disk.setdefault(picker, {}).update(entries)
        self.choices = on_disk
        data = {"format": FORMAT, "context": self.context,
                "choices": {p: {k: {"choice": None if c is None else list(c), "ms": ms}
                                for k, (c, ms) in sorted(e.items())}
                            for p, e in sorted(self.choices.items())}}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.chmod(tmp, 0o644)  # readable by other users of a shared cache (mkstemp makes it private)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("tuning cache %s: cannot write it (%s); the next engine tunes again", self.path, exc)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False
        self._dirty = False
        return True


def agrees(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    """got == want to within `rel` of want's largest entry (bf16 accuracy): how a picker accepts a candidate
    or a cached choice before its speed counts."""
    got, want = got.float(), want.float()
    return bool(torch.allclose(got, want, atol=rel * float(want.abs().max()) + 1e-3, rtol=rel))


def _decode_entry(entry) -> tuple[object, dict]:
    if not isinstance(entry, dict) or "choice" not in entry:
        raise ValueError(f"an entry must be {{'choice': ..., 'ms': ...}}, got {entry!r}")
    value, ms = entry["choice"], entry.get("ms") or {}
    if not isinstance(ms, dict):
        raise ValueError(f"`ms` must be a mapping, got {ms!r}")
    if value is None:
        return None, ms
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value), ms
    raise ValueError(f"a choice must be null or a list of integers, got {value!r}")


def reuse_or_tune(cache: TuningCache | None, picker: str, key, known, check, tune, timings: dict, device):
    """A picker's choice for a shape: the cache's, if it is still one of the `known` candidates and
    `check(choice)` (its result matches the reference once) holds; else `tune()`, whose choice and candidate
    times (`timings[key]`, filled by tune) go into the cache."""
    found, choice, ms = cache.get(picker, key) if cache is not None else (False, None, {})
    if found:
        try:
            ok = choice is None or (tuple(choice) in {tuple(k) for k in known} and check(choice))
        except Exception:  # noqa: BLE001 (a choice this build cannot launch: tune again)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            ok = False
        if ok:
            timings[key] = {**ms, "from_cache": True}
            return choice
        cache.forget(picker, key)
    choice = tune()
    if cache is not None:
        cache.put(picker, key, choice, {n: t for n, t in timings[key].items() if isinstance(t, float)})
    return choice
