"""The replay's progress over bag time: a tqdm bar on stderr, drawn only when stderr is a terminal (a log file
or a pipe gets none), redrawn at most ten times a second."""
from __future__ import annotations

import sys

from tqdm import tqdm

NS = 1_000_000_000


class Progress:
    def __init__(self, start_ns: int, end_ns: int, enabled: bool = True, stream=None, width: int = 30,
                 label: str = "replay"):
        self.start, self.span = start_ns, max(1, end_ns - start_ns)
        stream = stream or sys.stderr
        # disable=None is tqdm's "only on a terminal"
        self.bar = tqdm(total=self.span / NS, desc=f"  {label}", file=stream, mininterval=0.1,
                        disable=None if enabled else True, leave=True, dynamic_ncols=False,
                        bar_format="{desc} [{bar:" + str(width) + "}] {percentage:5.1f}%  bag {n:.2f}/{total:.2f} s"
                                   "{postfix}  {elapsed} wall")  # (tqdm writes the postfix as ", ...")

    def update(self, t_ns: int, decisions: int, force: bool = False) -> None:
        if self.bar.disable:
            return
        self.bar.set_postfix_str(f"{decisions} decisions", refresh=False)
        self.bar.n = min(self.bar.total, max(0.0, (t_ns - self.start) / NS))
        if force:
            self.bar.refresh()
        else:
            self.bar.update(0)  # redraws when mininterval has passed

    def close(self, t_ns: int, decisions: int) -> None:
        self.update(t_ns, decisions, force=True)
        self.bar.close()
