"""The CUDA GEMM-chain probe (benchmarks/cuda_chain_probe.py) without a GPU: the packed layouts hold every
weight / activation element where the kernel's address formula looks for it, the blocks' tile runs cover
each tile once and touch at most JMAX output chunks, and the partials the kernel's control flow produces add
up to x @ w^T. Where nvcc is installed, the kernels compile for sm_90a without register spills and without
ptxas serializing their wgmma instructions. That the
kernel itself computes those partials is checked on the GPU, against float64 torch."""
import re
import subprocess

import pytest
import torch

from benchmark_loading import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("cuda_chain_probe")


def _read_piece(probe, flat: torch.Tensor, tile: int, row: int, piece: int) -> torch.Tensor:
    """The 8 values the kernel reads for logical piece `piece` of `row` in tile `tile` (its `swizzled`)."""
    atom = 64 * probe.ATOM  # elements per atom
    at = tile * probe.TILE_BYTES // 2 + (piece >> 3) * atom + row * probe.ATOM + ((piece & 7) ^ (row & 7)) * probe.PIECE
    return flat[at:at + probe.PIECE]


def test_packed_weights_are_where_the_kernel_reads_them(probe):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(192, 384, generator=g).to(torch.bfloat16)  # 3 chunks x 3 k-tiles
    flat = probe.pack_weight(w)
    assert flat.numel() == w.numel()
    ktiles = 384 // probe.KTILE
    for chunk in range(3):
        for kt in range(ktiles):
            for row in (0, 5, 7, 8, 63):
                for piece in (0, 3, 15):
                    got = _read_piece(probe, flat, chunk * ktiles + kt, row, piece)
                    col = kt * probe.KTILE + piece * probe.PIECE
                    assert torch.equal(got, w[chunk * probe.COLS + row, col:col + probe.PIECE])
    with pytest.raises(ValueError, match="multiple"):
        probe.pack_weight(w[:100])


def test_packed_activations_are_where_the_kernel_reads_them(probe):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 256, generator=g).to(torch.bfloat16)
    flat = probe.pack_x(x)
    for kt in range(2):
        for row in (0, 1, 9, 49):
            for piece in range(16):
                atom = 2 * kt + (piece >> 3)
                at = (atom * 50 + row) * probe.ATOM + ((piece & 7) ^ (row & 7)) * probe.PIECE
                col = kt * probe.KTILE + piece * probe.PIECE
                assert torch.equal(flat[at:at + probe.PIECE], x[row, col:col + probe.PIECE])


@pytest.mark.parametrize("blocks", [132, 114])
def test_the_tile_runs_cover_each_tile_once(probe, blocks):
    table, x_offsets = probe.phase_table(2, blocks)
    assert len(table) == 2 * len(probe.LAYER_PHASES)
    assert list(x_offsets) == list(probe.GEMMS)
    for w_off, tiles, ktiles, *_ in table:
        if not tiles:
            continue
        seen = []
        for b in range(blocks):
            seen.extend(range(*probe.tile_range(tiles, b, blocks)))
        assert seen == list(range(tiles))
        assert probe.chunks_per_block(tiles, ktiles, blocks) <= probe.JMAX
    # consecutive GEMM phases' tiles are back to back in the weight buffer
    gemm_rows = [r for r in table if r[1]]
    for a, b in zip(gemm_rows, gemm_rows[1:]):
        assert b[0] == a[0] + a[1] * probe.TILE_BYTES
    with pytest.raises(ValueError, match="output chunks"):
        probe.phase_table(1, 20)  # few blocks: each run spans too many chunks for the kernel's partial slots


@pytest.mark.parametrize("blocks", [7, 13])
def test_the_partials_add_up_to_the_product(probe, blocks):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 512, generator=g).to(torch.bfloat16)
    w = (torch.randn(192, 512, generator=g) * 0.02).to(torch.bfloat16)
    parts, tags = probe.emulate_partials(x, w, blocks)
    assert int((tags >= 0).sum()) > 3  # the runs cross chunk boundaries: some blocks write two partials
    got = probe.reduce_partials(parts, tags, 192)
    want = x.double() @ w.double().T
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_the_kernel_compiles_for_sm90a_without_spills(probe, tmp_path):
    if probe.nvcc() is None:
        pytest.skip("no nvcc here")
    try:
        _, report = probe.compile_cubin(str(tmp_path))
    except (RuntimeError, subprocess.SubprocessError) as exc:
        if "sm_90a" in str(exc) and "not defined" in str(exc):
            pytest.skip(f"this nvcc cannot target sm_90a: {exc}")
        raise
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert len(spills) == len(regs) == len(probe.KERNELS), report  # one kernel per math mode
    assert all(pair == ("0", "0") for pair in spills), report
    assert max(regs) * probe.THREADS <= 65536, report  # one block of 10 warps fits an SM's registers
    assert "C7518" not in report, report  # ptxas did not serialize the wgmma instructions


def test_variant_names_give_the_kernel_arguments(probe):
    assert probe.parse_variant("stream") == {"math": 0, "xload": 0, "w_slots": 10, "x_slots": 3, "sync": 0,
                                             "weightless": True, "flat": False, "trace": False}
    assert probe.parse_variant("stream_x_s3") == {"math": 0, "xload": 1, "w_slots": 10, "x_slots": 3, "sync": 3,
                                                  "weightless": True, "flat": False, "trace": False}
    assert probe.parse_variant("gemm_w4_x2_s7_4ph") == {"math": 1, "xload": 1, "w_slots": 4, "x_slots": 2,
                                                        "sync": 7, "weightless": False, "flat": False, "trace": False}
    assert [probe.parse_variant(n)["math"] for n in ("stream", "gemm", "wgmma_s3", "wgmma2_w6_x6", "gemmgx")] == [
        0, 1, 2, 3, 4]
    assert probe.parse_variant("gemmgx_s3")["xload"] == 0  # its activations never go through the slots
    for bad in ("gemm_s32", "gemm_q2", "copy", "gemm_x", "gemm_flat", "stream_x_flat"):
        with pytest.raises(ValueError, match="variant"):
            probe.parse_variant(bad)
    assert probe.parse_variant("stream_w4_x2_flat")["flat"] and probe.parse_variant("gemm_s3_trace")["trace"]
    assert probe.flat_table(3 * probe.TILE_BYTES) == [[0, 3, 1 << 30, 0, 0, 0]]
    for name in probe.DEFAULT_VARIANTS:
        probe.parse_variant(name)
    table, _ = probe.phase_table(3, 132, weightless=False)
    assert [row[1] > 0 for row in table] == [True] * 3 * len(probe.GEMMS)


def test_the_trace_summary_reads_the_stamps(probe):
    """Two blocks, a layer of the 7 phases repeated over the probe's LAYERS: every step a known length."""
    names = [n for _ in range(probe.LAYERS) for n, _, _ in probe.LAYER_PHASES]
    stamps = torch.zeros(2, len(names), probe.TRACE, dtype=torch.int64)
    clock = 0
    for p, name in enumerate(names):
        weighted = dict((n, w) for n, w, _ in probe.LAYER_PHASES)[name] > 0
        for b in range(2):
            seen = clock + 1000 * (b + 1)  # block b sees the previous phase 1 or 2 us after its last arrival
            stamps[b, p, 0] = seen
            if weighted:
                stamps[b, p, 4] = seen - 500
                stamps[b, p, 1] = seen + 300
                stamps[b, p, 2] = seen + 300 + 4000 * (b + 1)
                stamps[b, p, 3] = stamps[b, p, 2] + 700
        clock = int(stamps[:, p, 3].max()) if weighted else int(stamps[:, p, 0].max())
    got = probe.summarize_trace(stamps, names)
    assert set(got) == {n for n, _, _ in probe.LAYER_PHASES}
    q = got["qkv"]
    assert q["seen"] == pytest.approx(1.5) and q["ready"] == pytest.approx(0.3) and q["tail"] == pytest.approx(0.7)
    assert q["math"] == pytest.approx(6.0) and q["math_max"] == pytest.approx(8.0) and q["lead"] == pytest.approx(0.8)
    assert q["span"] == pytest.approx(2 + 0.3 + 8 + 0.7)
    assert got["norm"]["span"] == pytest.approx(2.0) and "math" not in got["norm"]


def test_the_tile_summary_reads_the_tile_stamps(probe):
    names = [n for _ in range(probe.LAYERS) for n, _, _ in probe.LAYER_PHASES]
    tiles = torch.zeros(3, len(names), probe.TILE_STAMPS, 3, dtype=torch.int64)
    for p, name in enumerate(names):
        if name != "gate_up":
            continue
        for b in range(3):
            done = 0
            for i in range(4):  # each tile: weights 500 ns after the last was done, activations 250 later, 300 of math
                w = done + 500
                tiles[b, p, i] = torch.tensor([w, w + 250, w + 550])
                done = w + 550
    got = probe.summarize_tiles(tiles, names)
    assert set(got) == {"gate_up"}
    assert got["gate_up"] == pytest.approx({"w_gap": 0.5, "x_gap": 0.25, "tile": 1.05})
