"""Typed errors of the engine. Each message names the offending field, key, id or file."""


class FlashRTError(Exception):
    """Base class of every error the engine raises on purpose."""


class ContractError(FlashRTError):
    """An execution contract is malformed (cycle, unknown buffer, bad rate, ...)."""


class CheckpointError(FlashRTError):
    """A checkpoint is missing, unreadable, or its keys/shapes do not match the model."""


class CapsuleError(FlashRTError):
    """A capsule is unknown, corrupt, over budget, or from another runtime fingerprint."""


class InputError(FlashRTError):
    """An observation or prompt is malformed (shape, dtype, NaN, stamp going backwards)."""


class PrecisionError(FlashRTError):
    """A reduced precision is refused: its actions are too far from the unquantized model's (the numbers say)."""
