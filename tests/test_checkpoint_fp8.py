"""FP8 tensors (float8_e4m3fn, float8_e5m2, float8_e8m0fnu where torch has it) through every checkpoint tool.

Real files three ways: the workbench saver (DCP + workbench.json), the safetensors library's save_file,
and a hand-written safetensors header with F8_E8M0 (the MX block-scale dtype some loaders KeyError on).
Values are compared bit for bit (as uint8), statistics against fp32 references.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from workbench.checkpoint import (CheckpointFormatError, TrainState, diff, export, inspect, read_tensor, save,
                                  tensor_stats, verify)

E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7


class FP8Weights(nn.Module):
    """An FP8 layer as stored by FP8 training recipes: e4m3 weight, e5m2 copy, e8m0 block scales."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(32, 16, generator=g) * 3
        w[0, 0] = float("nan")  # e4m3fn has no inf, one NaN pattern: a non-finite value for verify to count
        self.w = nn.Parameter(w.to(torch.float8_e4m3fn), requires_grad=False)
        self.g = nn.Parameter(torch.randn(16, 16, generator=g).to(torch.float8_e5m2), requires_grad=False)
        if E8M0 is not None:
            self.register_buffer("scale", (2.0 ** torch.randint(-6, 7, (32,), generator=g)).to(E8M0))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory) -> tuple[Path, FP8Weights]:
    root = tmp_path_factory.mktemp("fp8")
    model = FP8Weights(0)
    save(root / "checkpoints", TrainState(model=model, step=1))
    (root / "checkpoints" / "latest").write_text("step-000001")
    return root, model


def test_fp8_checkpoint_inspects_verifies_converts_and_diffs(capsys, fp8_run, tmp_path):
    run, model = fp8_run
    want = {f"model.{k}": v for k, v in model.state_dict().items()}
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in want.items()}
    m = inspect(run)
    assert {r.key: r.dtype for r in m.tensors().itertuples() if r.kind == "model"} == dtypes
    assert int(m.row("model.w")["bytes"]) == 32 * 16  # one byte per element

    from workbench.cli import main
    capsys.readouterr()
    assert main(["ckpt", "inspect", str(run)]) == 0
    assert "float8_e4m3fn" in capsys.readouterr().out

    report = verify(run, deep=True, progress=False)
    assert report.ok, report
    assert report.warnings == ["model.w: 1 non-finite value(s) of 512"]

    # safetensors (one file, and HF shards), torch.save, and back to DCP: every byte survives
    outs = {"safetensors": tmp_path / "w.safetensors", "hf": tmp_path / "hf", "torch": tmp_path / "w.pt"}
    for to, dst in outs.items():
        if to == "safetensors":  # the shell's `workbench ckpt convert`
            assert main(["ckpt", "convert", str(run), str(dst), "--to", to]) == 0
        else:
            export(run, dst, to=to, progress=False)
        assert verify(dst, deep=True, progress=False).ok
        assert {r["key"]: r["dtype"] for r in inspect(dst).tensors().to_dict("records")} == \
            {k.removeprefix("model."): d for k, d in dtypes.items()}
        for k, t in want.items():
            assert torch.equal(_bits(read_tensor(dst, k)), _bits(t)), (to, k)
        assert diff(run, dst, kinds=["model"], progress=False).identical, to
    codes = {e["dtype"] for k, e in _header(outs["safetensors"]).items() if k != "__metadata__"}
    assert codes == {"F8_E4M3", "F8_E5M2"} | ({"F8_E8M0"} if E8M0 is not None else set())
    from safetensors import safe_open  # other tools read our export
    with safe_open(str(outs["safetensors"]), framework="pt") as f:
        assert torch.equal(_bits(f.get_tensor("g")), _bits(want["model.g"]))
    export(outs["hf"], tmp_path / "dcp", to="dcp", progress=False)
    assert inspect(tmp_path / "dcp").row("model.w")["dtype"] == "float8_e4m3fn"
    assert diff(run, tmp_path / "dcp", kinds=["model"], progress=False).identical

    # value changes are measured in fp32
    other = FP8Weights(1)
    save(tmp_path / "other", TrainState(model=other, step=1))
    d = diff(run, tmp_path / "other" / "step-000001", kinds=["model"], progress=False)
    row = d.values.set_index("key").loc["model.g"]
    ref = (want["model.g"].float() - other.g.float()).abs().max()
    assert not row["equal"] and row["max_abs"] == float(ref)


def test_fp8_stats_and_histogram_are_computed_in_fp32(fp8_run):
    run, model = fp8_run
    for key, t in (("model.w", model.w), ("model.g", model.g)) + ((("model.scale", model.scale),) if E8M0 else ()):
        s = tensor_stats(run, key, bins=16)
        x = t.float()
        finite = x[torch.isfinite(x)]
        assert s["dtype"] == str(t.dtype).removeprefix("torch.")
        assert s["non_finite"] == x.numel() - finite.numel()
        assert (s["min"], s["max"]) == (float(finite.min()), float(finite.max()))
        assert s["mean"] == pytest.approx(float(finite.double().mean()))
        assert sum(s["histogram"]["counts"]) == finite.numel()
    # the browser's histogram of an FP8 tensor: tests/test_checkpoint_browser.py (widgets imported there)


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand from (dtype code, shape, raw bytes), per the format's spec."""
    header, data = {}, b""
    for key, (code, shape, raw) in tensors.items():
        header[key] = {"dtype": code, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.skipif(E8M0 is None, reason="this torch has no float8_e8m0fnu")
def test_handwritten_f8_e8m0_and_library_fp8_safetensors(tmp_path):
    # e8m0 is a bare exponent: byte b means 2 ** (b - 127); 0xFF is NaN
    f = tmp_path / "scales.safetensors"
    _write_safetensors(f, {"blocks.scale": ("F8_E8M0", [2, 2], bytes([127, 128, 126, 255])),
                           "blocks.w": ("F8_E4M3", [4], bytes([0x38, 0xB8, 0x40, 0x00]))})  # 1, -1, 2, 0
    assert inspect(f).row("blocks.scale")["dtype"] == "float8_e8m0fnu"
    scale = read_tensor(f, "model.blocks.scale")
    assert scale.dtype == E8M0 and scale.float().flatten()[:3].tolist() == [1.0, 2.0, 0.5]
    assert read_tensor(f, "model.blocks.w").float().tolist() == [1.0, -1.0, 2.0, 0.0]
    s = tensor_stats(f, "blocks.scale", bins=3)
    assert (s["non_finite"], s["min"], s["max"], sum(s["histogram"]["counts"])) == (1, 0.5, 2.0, 3)
    report = verify(f, deep=True, progress=False)
    assert report.ok and report.warnings == ["model.blocks.scale: 1 non-finite value(s) of 4"]
    export(f, tmp_path / "dcp", to="dcp", progress=False)
    assert diff(f, tmp_path / "dcp", progress=False).identical

    from safetensors.torch import save_file
    lib = tmp_path / "lib.safetensors"
    w = torch.randn(8, 8).to(torch.float8_e4m3fn)
    save_file({"w": w, "v": torch.randn(8).to(torch.float8_e5m2)}, str(lib))
    assert torch.equal(_bits(read_tensor(lib, "model.w")), _bits(w))
    assert tensor_stats(lib, "w")["max"] == float(w.float().max())
    assert verify(lib, deep=True, progress=False).ok


def test_safetensors_dtypes_this_torch_cannot_hold_are_one_line_errors(tmp_path, monkeypatch):
    f = tmp_path / "x.safetensors"
    _write_safetensors(f, {"w": ("F8_E3M4", [2], b"\x00\x01")})
    with pytest.raises(CheckpointFormatError, match=r"x.safetensors: tensor 'w' has dtype 'F8_E3M4', which is not "
                                                    r"a safetensors dtype; re-export it in one of \["):
        inspect(f)
    # an older torch without float8_e8m0fnu: the file is refused by name, never a KeyError
    from workbench.checkpoint import safeload
    monkeypatch.delitem(safeload.SAFETENSORS_DTYPES, "F8_E8M0", raising=False)
    _write_safetensors(f, {"s": ("F8_E8M0", [1], b"\x7f")})
    with pytest.raises(CheckpointFormatError, match=r"'s' has dtype 'F8_E8M0', which torch .* cannot hold "
                                                    r"\(no torch.float8_e8m0fnu\); upgrade torch"):
        inspect(f)
    assert "upgrade torch" in str(verify(f, progress=False).problems[0])


def test_dcp_metadata_with_a_dtype_this_torch_lacks_names_it(fp8_run, monkeypatch):
    from workbench.checkpoint import safeload
    monkeypatch.setitem(safeload._ALLOWED, "torch", safeload._ALLOWED["torch"] - {"float8_e5m2"})
    with pytest.raises(CheckpointFormatError, match=r"\.metadata: the checkpoint holds torch.float8_e5m2 tensors, "
                                                    r"a dtype torch .* does not have; read it with a newer torch"):
        inspect(fp8_run[0])
