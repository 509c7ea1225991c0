"""pi0 (LeRobot 0.6.1 `PI0Policy` layout): the pi0.5 prefix, a state token and the action-time MLP in the
expert. `reference` is the eager fp32 model; the checkpoint loader and config are pi0.5's (`kind` "pi0")."""
from flashrt_core.models.pi0.policy import Pi0Policy, load, pi0_prompt
from flashrt_core.models.pi0.weights import Pi0Weights, convert

__all__ = ["Pi0Policy", "Pi0Weights", "convert", "load", "pi0_prompt"]
