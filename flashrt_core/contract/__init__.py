"""The execution contract: stages, rates and named buffers as validated data, and the Runtime that runs them.

The spec and scheduler are pure Python (no torch); `Runtime` is imported lazily.
"""
from flashrt_core.contract.schedule import Scheduler, simulate
from flashrt_core.contract.spec import Contract, load_contract, validate

__all__ = ["Contract", "load_contract", "validate", "Scheduler", "simulate", "Runtime", "StepResult"]


def __getattr__(name):
    if name in ("Runtime", "StepResult"):
        from flashrt_core.contract import runtime

        return getattr(runtime, name)
    raise AttributeError(name)
