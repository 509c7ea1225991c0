"""SmolVLA (LeRobot 0.6.1 `policies/smolvla`): config, LeRobot weights, eager reference, fused engine.

    from flashrt_core.models.smolvla import SmolVLAConfig, convert, reference
    config = SmolVLAConfig.from_lerobot(config_json, vlm_config_json)
    weights = convert(config, state_dict)                    # LeRobot's model.safetensors keys
    actions = reference.sample_actions(weights, images, image_masks, lang_tokens, lang_mask, state, noise)
"""
from flashrt_core.models.smolvla.config import LlamaConfig, SigLIPConfig, SmolVLAConfig
from flashrt_core.models.smolvla.policy import SmolVLAPolicy, load
from flashrt_core.models.smolvla.reference import PrefixCache
from flashrt_core.models.smolvla.weights import SmolVLAWeights, check_keys, convert, expected_keys

__all__ = ["load", "SmolVLAPolicy", "SmolVLAConfig", "SigLIPConfig", "LlamaConfig", "SmolVLAWeights", "PrefixCache",
           "convert", "check_keys", "expected_keys"]
