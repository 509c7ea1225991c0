"""Shared JSON result writer for benchmarks: every file says which GPU, which commit, when, and what workload.

    from _common import write_result
    write_result(path, workload={...}, results={"system": {...}}, extra={...})
Torch is optional (the GPU name is "cpu" / "unknown" without it).
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]


def gpu_name() -> str:
    try:
        import torch
    except ImportError:
        return "unknown"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def commit() -> str:
    """HEAD of this checkout (with '+dirty' when tracked files changed); FLASHRT_COMMIT overrides it (copies
    of the tree without .git, e.g. on the GPU machine); 'unknown' outside git."""
    if os.environ.get("FLASHRT_COMMIT"):
        return os.environ["FLASHRT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def header(workload: dict) -> dict:
    return {"gpu": gpu_name(), "commit": commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "workload": workload}


def write_result(path, workload: dict, results: dict, extra: dict | None = None) -> dict:
    """Write {gpu, commit, date, workload, results, **extra} as JSON to `path` (folders created); return it."""
    doc = {**header(workload), "results": results, **(extra or {})}
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc
