"""The one error replay raises on purpose: bad bags, bad mappings, inputs the runtime refuses."""
from __future__ import annotations


class ReplayError(ValueError):
    """A bag cannot be (fully) replayed; the message names the bag, topic, message or key.

    `report` is the partial report of what was read before the problem (None when nothing was), and
    `report_dir` where it was written, if anywhere.
    """

    def __init__(self, message: str, report=None, report_dir=None):
        super().__init__(message)
        self.report = report
        self.report_dir = report_dir
