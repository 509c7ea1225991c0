"""benchmarks/profile_pi05.py without a GPU: its options (the per-kernel profile of the one engine; there is no
A/B switch, the engine has no A/B flags) and the GEMM table it prints from the engine picker's report."""
import pytest

from benchmark_loading import load_benchmark


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("profile_pi05")


def test_options_and_no_ab_switch(profile):
    args = profile.parse_args(["--views", "1", "--pdl", "0", "--gemm-configs", "[(32, 256, 1, 4, 3)]"])
    assert (args.views, args.pdl, args.gemm, args.gemm_configs) == (1, 0, "auto", "[(32, 256, 1, 4, 3)]")
    with pytest.raises(SystemExit):
        profile.parse_args(["--ab", "gemm_preload"])


def test_gemm_table_names_the_choice_its_bandwidth_and_the_fastest(profile, capsys):
    """A report row of `LinearPicker.report()`: the chosen candidate's time and GB/s (weight bytes / time), the
    fastest candidate and cuBLAS; rows without timed candidates (read from the cache) are skipped."""
    rows = [{"m": 50, "weight": [1024, 4096], "bias": False, "geglu": False, "dtype": "torch.bfloat16",
             "fused": ["defer"], "choice": "(64, 128, 4, 4, 4)",
             "ms": {"cublas": 8.5e-3, "(64, 128, 4, 4, 4)": 5.0e-3, "(32, 128, 8, 4, 4)": 4.9e-3,
                    "(16, 256, 1, 4, 4)": "mismatch: disagrees with cuBLAS"}},
            {"m": 50, "weight": [2560, 1024], "bias": False, "geglu": False, "dtype": "torch.bfloat16",
             "fused": [], "choice": "cublas", "ms": None}]
    profile.gemm_table(rows)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0] == ("gemm [50x4096] x [1024x4096]^T +defer: chose (64, 128, 4, 4, 4) 5.00 us (1678 GB/s); "
                        "fastest (32, 128, 8, 4, 4); cublas 8.50 us")
