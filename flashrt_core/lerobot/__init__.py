"""What every LeRobot checkpoint shares: processors, normalization, letterbox, tokenizers, the policy API."""
