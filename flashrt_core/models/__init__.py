"""Model implementations (weights, eager reference, fused engine): `flashrt_core.models.pi05`."""
