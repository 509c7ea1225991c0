"""FlashRT core: the inference engine, execution contract and capsules. Never imports rclpy."""
from flashrt_core.errors import CapsuleError, CheckpointError, ContractError, FlashRTError, InputError

__all__ = ["Runtime", "ContractError", "CheckpointError", "CapsuleError", "InputError", "FlashRTError"]
__version__ = "0.1.0"


def __getattr__(name):
    # Runtime pulls in torch and the models; import it lazily so `flashrt doctor` stays light.
    if name == "Runtime":
        from flashrt_core.contract.runtime import Runtime

        return Runtime
    raise AttributeError(name)
