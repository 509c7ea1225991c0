"""benchmarks/profile_pi05.py's A/B switch: every flag it can flip is a boolean Pi05Engine setting, and a
comma-separated list flips several together (one device call measures them as one variant)."""
import argparse
import inspect

import pytest

from benchmark_loading import load_benchmark


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("profile_pi05")


def test_every_ab_flag_is_a_boolean_engine_setting(profile):
    from flashrt_core.models.pi05.engine import Pi05Engine

    params = inspect.signature(Pi05Engine).parameters
    for flag in profile.AB_FLAGS:
        assert flag in params and isinstance(params[flag].default, bool), flag


def test_ab_takes_one_flag_or_several(profile):
    assert profile.ab_flags("gemm_preload") == ["gemm_preload"]
    assert profile.ab_flags("gemm_preload, early_modulation") == ["gemm_preload", "early_modulation"]
    for bad in ("", "gemm_preload,warp_speed", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="--ab"):
            profile.ab_flags(bad)
