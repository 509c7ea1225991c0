"""The packed LeRobot golden cases of test/fixtures/ decode bit for bit (digest-checked); damaged files are refused."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lerobot_cases import PI05_CASES, case_fields, load_case_tensors, pack_cases, save_packed_cases

# Tolerances: none; every comparison here is exact (bit-for-bit).


@pytest.mark.parametrize("folder", ["lerobot_pi05_tiny", "lerobot_pi0_tiny"])
def test_fixture_cases_decode_to_the_recorded_lerobot_tensors(fixtures_dir, folder):
    raw = load_case_tensors(fixtures_dir / folder / "cases.safetensors")  # raises unless every digest matches
    cases = case_fields(raw, PI05_CASES)
    assert sum(len(c) for c in cases.values()) == len(raw)
    for c in cases.values():
        assert c["actions"].shape == c["noise"].shape == (1, 50, 32) and c["actions"].dtype == torch.float32
        assert all(c[f"image.{i}"].shape == (1, 3, 224, 224) and c[f"image.{i}"].dtype == torch.float32
                   for i in range(3))
        assert c["lang_tokens"].dtype == torch.int64 and c["lang_mask"].dtype == torch.bool
        assert ("state_padded" in c) == (folder == "lerobot_pi0_tiny")
    two_missing = cases["one_view_240x320_two_missing"]
    assert two_missing["raw_image.0"].shape == (1, 3, 240, 320) and "raw_image.1" not in two_missing


def test_pack_round_trip_is_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    few = torch.randint(0, 256, (2, 3, 5, 7), generator=g).float() / 255
    few[0, 0, 0, :2] = torch.tensor([0.0, -0.0])  # two bit patterns that compare equal
    tensors = {"few": few, "many": torch.randn(4, 300, generator=g), "ints": torch.arange(6).view(1, 6),
               "mask": torch.tensor([True, False])}
    stored, _ = pack_cases(tensors)
    assert stored["few.u8"].dtype == torch.uint8 and "many" in stored and "few" not in stored
    save_packed_cases(tensors, tmp_path / "c.safetensors")
    back = load_case_tensors(tmp_path / "c.safetensors")
    assert set(back) == set(tensors)
    for key, t in tensors.items():
        assert back[key].dtype == t.dtype and back[key].shape == t.shape
        assert torch.equal(back[key].reshape(-1).view(torch.uint8) if t.dtype != torch.bool else back[key],
                           t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t), key


def test_a_changed_tensor_or_a_plain_file_is_refused(tmp_path):
    path = tmp_path / "c.safetensors"
    save_packed_cases({"x": torch.linspace(0, 1, 11)}, path)
    with safe_open(str(path), framework="pt") as f:
        meta, stored = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    stored["x.palette"][3] += 1e-7
    save_file(stored, str(path), metadata=meta)
    with pytest.raises(ValueError, match="differ from the recorded LeRobot output"):
        load_case_tensors(path)
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="not a packed cases file"):
        load_case_tensors(path)
