"""The units of work of an evaluation: every bag named on the command line (a bag, a folder of bags, a glob) and
every episode of a LeRobot dataset folder, each with a key that stays the same from one run to the next (its
result file in the report folder is named after it)."""
from __future__ import annotations

import glob
import hashlib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

BAG_FILES = (".mcap", ".db3")


class EvaluateError(ValueError):
    """The evaluation as a whole cannot run (no bags, a report folder of another evaluation, a contract that
    does not build); a bag that cannot be replayed is a row of the report instead."""


@dataclass
class Unit:
    key: str  # file name of its result: <name>-<8 hex of its resolved path>
    path: str  # the bag, or the LeRobot dataset folder
    episode: int | None = None  # a LeRobot dataset's episode index
    error: str | None = None  # known before any replay (a dataset whose episodes cannot be listed)
    deaths: list = field(default_factory=list)  # why the workers that replayed it died, attempt by attempt
    avoid: list = field(default_factory=list)  # actors it died on: handed to another one when there is one

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def label(self) -> str:
        return self.path if self.episode is None else f"{self.path} episode {self.episode}"


def _key(name: str, identity: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "bag"
    return f"{name[:80]}-{hashlib.sha1(identity.encode()).hexdigest()[:8]}"


def is_bag(path: Path) -> bool:
    if path.is_file():
        return path.suffix in BAG_FILES
    return path.is_dir() and ((path / "metadata.yaml").is_file()
                              or any(p.suffix in BAG_FILES and p.is_file() for p in path.iterdir()))


def is_lerobot_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "meta" / "info.json").is_file()


def _bag_unit(path: Path) -> Unit:
    resolved = path.resolve()
    return Unit(_key(path.stem if path.is_file() else path.name, str(resolved)), str(path))


def _dataset_units(path: Path) -> list[Unit]:
    """One unit per episode; the episodes are converted to a bag by the worker that replays them
    (flashrt_ros.replay.lerobot_dataset)."""
    resolved = str(path.resolve())
    try:
        from flashrt_ros.replay import lerobot_dataset
        from flashrt_ros.replay.errors import ReplayError
    except ImportError as e:
        raise EvaluateError(f"{path}: a LeRobot dataset, but its reader is not installed ({e})") from None
    try:
        indices = [ep.index for ep in lerobot_dataset.episodes(path)]
    except ReplayError as e:  # a dataset that cannot be read is one row with its error, not a failed evaluation
        return [Unit(_key(path.name, resolved), str(path), error=str(e))]
    return [Unit(_key(f"{path.name}-episode_{i:06d}", f"{resolved}#{i}"), str(path), episode=i) for i in indices]


def _walk(folder: Path) -> list[Path]:
    """Bags and datasets under a folder that is neither (hidden folders skipped), in name order."""
    found = []
    for child in sorted(folder.iterdir()):
        if child.name.startswith("."):
            continue
        if is_lerobot_dataset(child) or is_bag(child):
            found.append(child)
        elif child.is_dir():
            found.extend(_walk(child))
    return found


def expand(names) -> list[Unit]:
    """BAGS arguments -> units, in the order given (a folder's bags in name order), each path once."""
    paths: list[Path] = []
    for name in names:
        p = Path(name)
        if not p.exists() and glob.has_magic(str(name)):
            matches = sorted(glob.glob(str(name)))
            if not matches:
                raise EvaluateError(f"{name}: the pattern matches nothing")
            paths.extend(Path(m) for m in matches)
        elif not p.exists():
            raise EvaluateError(f"{name}: no such bag, folder or file")
        else:
            paths.append(p)
    units, seen = [], set()
    for p in paths:
        if is_lerobot_dataset(p):
            found = [p]
        elif is_bag(p) or p.is_file():  # (a file of another kind is a row saying what it is not)
            found = [p]
        else:
            found = _walk(p)
            if not found:
                raise EvaluateError(f"{p}: no bag (a folder with metadata.yaml, .mcap or .db3) and no LeRobot "
                                    "dataset (meta/info.json) in this folder")
        for f in found:
            if f.resolve() in seen:
                continue
            seen.add(f.resolve())
            units.extend(_dataset_units(f) if is_lerobot_dataset(f) else [_bag_unit(f)])
    if not units:
        raise EvaluateError("no bags to evaluate")
    return units


def dataset_topic_map(units):
    """The topic mapping of the LeRobot datasets among the units (their bags carry the datasets' feature names),
    or None when there is none; datasets with different cameras or joints cannot share one runtime."""
    datasets = sorted({u.path for u in units if u.episode is not None})
    if not datasets:
        return None
    from flashrt_ros.replay import lerobot_dataset

    maps = {d: lerobot_dataset.topic_map(d) for d in datasets}
    first = maps[datasets[0]]
    for d, m in maps.items():
        if m != first:
            raise EvaluateError(f"LeRobot datasets {datasets[0]} and {d} carry different cameras or joints "
                                f"({first.describe()} vs {m.describe()}): evaluate them separately")
    return first
