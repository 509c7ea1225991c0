"""Exported capsules: bit-exact round trips, and refusal of corrupt, truncated or foreign files."""
import argparse
import io
import json
import pathlib

import pytest
import torch

from flashrt_core.capsule import CapsuleStore, add_subparsers, capsule_inspect, fingerprint, inspect
from flashrt_core.errors import CapsuleError

# Tolerance table: exported bytes must come back unchanged (0 ULP) on every dtype.
TOLERANCE_ULP = {"export_import": 0}

LAYOUT = {
    "prefix_k": ((3, 1, 19, 8), torch.bfloat16),
    "prefix_v": ((3, 1, 19, 8), torch.bfloat16),
    "chunk": ((1, 5, 7), torch.float32),
    "step": ((), torch.int64),
    "valid": ((11,), torch.bool),
}
FP = fingerprint("pi05-tiny", "sha256:abc", "bfloat16", LAYOUT)


def make_state(seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in LAYOUT.items():
        if dtype.is_floating_point:
            out[name] = (torch.randn(shape, generator=g) - 0.3).to(dtype)
        elif dtype == torch.bool:
            out[name] = torch.rand(shape, generator=g) > 0.5
        else:
            out[name] = torch.randint(1, 1000, shape, generator=g).to(dtype)
    return out


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b):
    for k in a:
        assert torch.equal(bits(a[k]), bits(b[k])), f"buffer {k} differs"


def exported(tmp_path, seed=1, tier="device"):
    s = CapsuleStore(FP, disk_dir=tmp_path / "store")
    live = make_state(seed)
    meta = {"decision_id": 42, "rng": torch.Generator().manual_seed(3).get_state(), "stamps": [1, 2]}
    cid = s.snapshot("grasp", tier, live, meta)
    path = tmp_path / "caps" / "x"
    s.export(cid, path)
    return s, cid, live, meta, path


def tensor_offset(path, name):
    """Absolute byte offset of buffer `name` inside the safetensors file."""
    data = (path / "buffers.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    return 8 + n + json.loads(data[8:8 + n])[name]["data_offsets"][0]


def tensor_end(path, name):
    data = (path / "buffers.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    return 8 + n + json.loads(data[8:8 + n])[name]["data_offsets"][1]


def flip(file, offset):
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x5A
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("src_tier,dst_tier", [("device", "host"), ("host", "device"), ("disk", "disk")])
def test_export_import_round_trip_is_bit_exact(tmp_path, src_tier, dst_tier):
    _, _, live, meta, path = exported(tmp_path, tier=src_tier)
    other = CapsuleStore(FP, disk_dir=tmp_path / "other")  # a second runtime with the same fingerprint
    cid = other.import_(path, dst_tier)
    into = make_state(77)
    got = other.restore(cid, into)
    assert_same(into, live)
    assert got["decision_id"] == 42 and got["stamps"] == [1, 2] and torch.equal(got["rng"], meta["rng"])
    assert other.list()[0]["name"] == "grasp" and other.list()[0]["tier"] == dst_tier
    assert capsule_inspect(path, out=io.StringIO()) == 0


def test_export_is_atomic_and_refuses_to_overwrite(tmp_path):
    s, cid, _, _, path = exported(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == ["buffers.safetensors", "manifest.json"]
    assert [p.name for p in path.parent.iterdir()] == ["x"]  # no temporary folder left behind
    with pytest.raises(CapsuleError, match="already exists"):
        s.export(cid, path)


@pytest.mark.parametrize("victim", ["prefix_v", "chunk", "valid"])
def test_flipped_byte_in_a_buffer_is_refused_naming_it(tmp_path, victim):
    _, _, _, _, path = exported(tmp_path)
    flip(path / "buffers.safetensors", tensor_offset(path, victim) + 1)
    other = CapsuleStore(FP)
    with pytest.raises(CapsuleError, match=f"buffer {victim} in .*checksum failed"):
        other.import_(path)
    assert other.list() == []
    manifest, checks = inspect(path)
    assert manifest["id"] and [c.item for c in checks if not c.ok] == [f"buffer {victim}"]
    assert capsule_inspect(path, out=io.StringIO()) == 1


def test_flipped_byte_in_the_header_or_manifest_is_refused(tmp_path):
    _, _, _, _, path = exported(tmp_path)
    flip(path / "buffers.safetensors", 9)  # inside the safetensors JSON header
    with pytest.raises(CapsuleError, match="header checksum failed"):
        CapsuleStore(FP).import_(path)
    assert capsule_inspect(path, out=io.StringIO()) == 1

    _, _, _, _, path2 = exported(tmp_path / "b")
    text = (path2 / "manifest.json").read_text()
    (path2 / "manifest.json").write_text(text.replace('"decision_id": 42', '"decision_id": 43'))
    with pytest.raises(CapsuleError, match="manifest checksum failed"):
        CapsuleStore(FP).import_(path2)
    assert capsule_inspect(path2, out=io.StringIO()) == 1


def test_truncated_file_names_the_cut_buffer(tmp_path):
    _, _, _, _, path = exported(tmp_path)
    file = path / "buffers.safetensors"
    cut = tensor_offset(path, "chunk") + 5
    file.write_bytes(file.read_bytes()[:cut])
    with pytest.raises(CapsuleError, match="buffer chunk in .*truncated"):
        CapsuleStore(FP).import_(path)
    _, checks = inspect(path)
    failed = {c.item for c in checks if not c.ok}
    intact = {f"buffer {k}" for k in LAYOUT if tensor_end(path, k) <= cut}
    assert intact and "file" in failed and "buffer chunk" in failed and not intact & failed


def test_corrupt_disk_tier_capsule_leaves_live_untouched(tmp_path):
    s = CapsuleStore(FP, disk_dir=tmp_path)
    live = make_state(5)
    cid = s.snapshot("d", "disk", live, {})
    live2 = make_state(6)
    for k in live:
        live[k].copy_(live2[k])
    flip(tmp_path / cid / "buffers.safetensors", tensor_offset(tmp_path / cid, "prefix_k") + 3)
    with pytest.raises(CapsuleError, match=f"restore of capsule {cid}: buffer prefix_k"):
        s.restore(cid, live)
    assert_same(live, live2)


@pytest.mark.parametrize("field,expect", [
    ("precision", "precision: bfloat16 != float32"),
    ("layout", r"buffer chunk: shape \(1,5,7\) != \(1,5,9\)"),
    ("model", "model: pi05-tiny != pi0-tiny"),
])
def test_foreign_fingerprint_is_refused_naming_the_difference(tmp_path, field, expect):
    layout = dict(LAYOUT)
    args = {"model": "pi05-tiny", "weights_digest": "sha256:abc", "precision": "bfloat16"}
    if field == "precision":
        args["precision"] = "float32"
    elif field == "model":
        args["model"] = "pi0-tiny"
    else:
        layout["chunk"] = ((1, 5, 9), torch.float32)
    foreign = CapsuleStore(fingerprint(layout=layout, **args))
    state = make_state(8)
    state["chunk"] = torch.randn(layout["chunk"][0])
    cid = foreign.snapshot("f", "host", state, {})
    foreign.export(cid, tmp_path / "f")
    mine = CapsuleStore(FP)
    with pytest.raises(CapsuleError, match=expect):
        mine.import_(tmp_path / "f")
    assert mine.list() == []


def test_inspect_cli_accepts_folder_or_file_and_reports(tmp_path):
    _, cid, _, _, path = exported(tmp_path)
    out = io.StringIO()
    assert capsule_inspect(path / "manifest.json", out=out) == 0
    text = out.getvalue()
    assert cid in text and "prefix_k" in text and "FAIL" not in text and "0 failed" in text
    parser = argparse.ArgumentParser(prog="flashrt")
    add_subparsers(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["capsule", "inspect", str(path)])
    assert args.func(args) == 0
    missing = parser.parse_args(["capsule", "inspect", str(tmp_path / "nothing")])
    assert missing.func(missing) == 1


def test_import_of_a_missing_path_is_named(tmp_path):
    with pytest.raises(CapsuleError, match=str(pathlib.Path(tmp_path / "none"))):
        CapsuleStore(FP).import_(tmp_path / "none")


def test_a_capsule_whose_buffers_disagree_with_its_own_fingerprint_is_refused(tmp_path):
    """Checksums only prove a file is what its writer wrote: a capsule written (or hand-edited, checksums
    recomputed) with buffers other than its fingerprint's layout is refused at import, before it takes a slot."""
    from flashrt_core.capsule import diskfmt

    bad = make_state(2)
    bad["chunk"] = bad["chunk"][:, :4]  # [1, 4, 7] where the layout says [1, 5, 7]
    path = tmp_path / "forged"
    diskfmt.write_capsule(path, capsule_id="c0001-ffff", name="forged", created=0.0, fingerprint=FP.to_dict(),
                          fingerprint_digest=FP.digest(), meta={"decision_id": 1}, tensors=bad)
    store = CapsuleStore(FP)
    with pytest.raises(CapsuleError, match=r"buffer chunk is float32 \(1,4,7\), the fingerprint says float32 \(1,5,7\)"):
        store.import_(path)
    missing = dict(make_state(2))
    del missing["valid"]
    path2 = tmp_path / "forged2"
    diskfmt.write_capsule(path2, capsule_id="c0002-ffff", name="forged", created=0.0, fingerprint=FP.to_dict(),
                          fingerprint_digest=FP.digest(), meta={"decision_id": 1}, tensors=missing)
    with pytest.raises(CapsuleError, match=r"missing \['valid'\]"):
        store.import_(path2)
    assert store.list() == []


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(buffers=list(m["buffers"])), "buffers is a list, not a mapping"),
    (lambda m: m.update(meta=[1, 2]), "meta is a list, not a mapping"),
    (lambda m: m.update(fingerprint="pi05"), "fingerprint is a str, not a mapping"),
    (lambda m: m["buffers"]["chunk"].pop("nbytes"), "buffers.chunk lacks shape, dtype, nbytes or sha256"),
    (lambda m: m.update(tensors_file=None), "tensors_file None is not a file name"),
    (lambda m: m.update(tensors_file="../other/buffers.safetensors"), "is not a file name inside the capsule folder"),
])
def test_a_malformed_manifest_is_a_failed_check_not_a_crash(tmp_path, edit, message):
    """`capsule inspect` never raises on bad data, even where the manifest's checksum was recomputed: fields of
    the wrong type, and a tensors file outside the capsule folder, are refused before anything is followed."""
    from flashrt_core.capsule import diskfmt

    _, _, _, _, path = exported(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    manifest["manifest_sha256"] = diskfmt._manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    out = io.StringIO()
    assert capsule_inspect(path, out=out) == 1
    assert message in out.getvalue(), out.getvalue()
    with pytest.raises(CapsuleError, match="malformed manifest"):
        CapsuleStore(FP).import_(path)


def test_inspect_of_a_plain_file_says_it_is_not_a_capsule_folder(tmp_path):
    """It said `[Errno 20] Not a directory`."""
    plain = tmp_path / "notes.txt"
    plain.write_text("not a capsule")
    out = io.StringIO()
    assert capsule_inspect(plain, out=out) == 1
    assert f"FAIL manifest: {plain} is not a capsule folder (a file;" in out.getvalue()
    assert "Errno" not in out.getvalue()
