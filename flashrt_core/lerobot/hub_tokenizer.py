"""Tokenizers found on disk by the name a checkpoint records, never downloaded at run time.

A LeRobot checkpoint does not contain its tokenizer: its pre-processor only records the Hugging Face name
(`tokenizer_name: google/paligemma-3b-pt-224`). `resolve_tokenizer` looks, in this order, at:
1. an explicit path (node parameter `tokenizer`, contract `model.options.tokenizer`, `--tokenizer`): a
   `tokenizer.json`, a SentencePiece `tokenizer.model`, or a folder holding one of them;
2. the checkpoint folder itself;
3. the Hugging Face hub cache, offline: `$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`, in
   `models--<org>--<name>/snapshots/<revision>/` (the revision `refs/main` names first, then the newest).
`tokenizer.json` is read with the `tokenizers` library (what transformers' fast tokenizers run), a
`tokenizer.model` with sentencepiece. When nothing is found, the error lists every place looked and the one
command that fetches the files.
"""
from __future__ import annotations

import json
import os
import pathlib

from flashrt_core.errors import CheckpointError, InputError

PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"
FILES = ("tokenizer.json", "tokenizer.model")  # in order of preference


class HubTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers`), with BOS and pad ids from the files beside it."""

    def __init__(self, path: str | os.PathLike):
        import tokenizers

        path = pathlib.Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type for malformed files
            raise InputError(f"tokenizer: {path}: not a tokenizers JSON file ({e})") from None
        special = _special_tokens(path.parent)
        self.bos_id = self._id(special.get("bos_token", "<bos>"), path, "bos")
        pad = special.get("pad_token", "<pad>")
        self.pad_id = self._tok.token_to_id(pad) if self._tok.token_to_id(pad) is not None else 0
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.path = path

    def _id(self, token: str, path: pathlib.Path, what: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise InputError(f"tokenizer: {path}: no {what} token {token!r} in the vocabulary")
        return int(i)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def _special_tokens(folder: pathlib.Path) -> dict[str, str]:
    """bos/pad token strings from tokenizer_config.json or special_tokens_map.json (either may be absent)."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            doc = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"tokenizer: {file}: unreadable JSON ({e})") from None
        for key in ("bos_token", "pad_token"):
            v = doc.get(key) if isinstance(doc, dict) else None
            if isinstance(v, dict):  # {"content": "<bos>", ...}
                v = v.get("content")
            if isinstance(v, str):
                out[key] = v
    return out


def open_tokenizer(file: str | os.PathLike):
    """A Tokenizer for one `tokenizer.json` or `tokenizer.model` file."""
    file = pathlib.Path(file)
    if file.suffix == ".json":
        return HubTokenizer(file)
    from flashrt_core.lerobot.tokenize import SentencePieceTokenizer

    return SentencePieceTokenizer(file)


def hub_cache_dirs() -> list[pathlib.Path]:
    """The Hugging Face hub cache folders, in the order the hub library itself uses them."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser())
    if os.environ.get("HF_HOME"):
        dirs.append(pathlib.Path(os.environ["HF_HOME"]).expanduser() / "hub")
    dirs.append(pathlib.Path("~/.cache/huggingface/hub").expanduser())
    unique: list[pathlib.Path] = []
    for d in dirs:
        if d not in unique:
            unique.append(d)
    return unique


def _in_folder(folder: pathlib.Path) -> pathlib.Path | None:
    for name in FILES:
        if (folder / name).is_file():
            return folder / name
    return None


def _snapshots(repo: pathlib.Path) -> list[pathlib.Path]:
    """Snapshot folders of one cached repo: the one refs/main names first, then the newest."""
    snaps = repo / "snapshots"
    if not snaps.is_dir():
        return []
    found = sorted((p for p in snaps.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    ref = repo / "refs" / "main"
    if ref.is_file():
        main = snaps / ref.read_text().strip()
        if main in found:
            found.remove(main)
            found.insert(0, main)
    return found


def find_tokenizer_file(name: str, explicit=None, folder=None) -> tuple[pathlib.Path | None, list[str]]:
    """(file or None, every place looked) for the tokenizer called `name`."""
    looked: list[str] = []
    if explicit:
        p = pathlib.Path(explicit).expanduser()
        if p.is_file():
            return p, looked
        if p.is_dir() and _in_folder(p):
            return _in_folder(p), looked
        raise CheckpointError(f"tokenizer: {p} is neither a tokenizer.json / tokenizer.model file nor a folder "
                              "holding one")
    if folder is not None:
        looked.append(str(folder))
        hit = _in_folder(pathlib.Path(folder))
        if hit:
            return hit, looked
    repo_dir = "models--" + name.replace("/", "--")
    for cache in hub_cache_dirs():
        looked.append(str(cache / repo_dir))
        for snap in _snapshots(cache / repo_dir):
            hit = _in_folder(snap)
            if hit:
                return hit, looked
    return None, looked


def resolve_tokenizer(name: str = PALIGEMMA_TOKENIZER, explicit=None, folder=None):
    """The tokenizer a checkpoint names, opened from disk (see the module docstring); CheckpointError listing
    every place looked when there is none."""
    file, looked = find_tokenizer_file(name, explicit, folder)
    if file is None:
        raise CheckpointError(
            f"tokenizer {name!r}: no {' or '.join(FILES)} found; looked in " + ", ".join(looked)
            + f". Fetch it once with `hf download {name} tokenizer.json tokenizer_config.json "
            "special_tokens_map.json` (a gated model: `hf auth login` first), or give its path (node parameter "
            "`tokenizer`, `flashrt run --tokenizer`, contract `model.options.tokenizer`)")
    return open_tokenizer(file)


def find_hub_folder(name: str, file: str, explicit=None, how: str = "") -> pathlib.Path:
    """The folder holding `file` of the hub repo `name` (a model's own config, say): `explicit` (a folder or the
    file) first, then the hub cache's snapshots; CheckpointError naming every place looked and how to fetch it."""
    if explicit:
        p = pathlib.Path(explicit).expanduser()
        p = p.parent if p.is_file() else p
        if (p / file).is_file():
            return p
        raise CheckpointError(f"{name}: {p} holds no {file}")
    looked = []
    for cache in hub_cache_dirs():
        repo = cache / ("models--" + name.replace("/", "--"))
        looked.append(str(repo))
        for snap in _snapshots(repo):
            if (snap / file).is_file():
                return snap
    raise CheckpointError(f"{name}: no {file} found; looked in {', '.join(looked)}. Fetch it once with "
                          f"`hf download {name} {file} tokenizer.json tokenizer_config.json`, or give its folder"
                          + (f" ({how})" if how else ""))
