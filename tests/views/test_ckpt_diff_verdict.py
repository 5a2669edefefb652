"""Issue 28, finding 11: "different" only when tensors differ, and the banner names the kinds that differ.

A DCP checkpoint and its own Hugging Face export hold the same 48 weights (192 tensors with the optimizer
state), bit for bit; the export simply has no RNG states, LR scheduler or step counters (nor, without
``--include optimizer``, any optimizer state or hyper-parameters). Those are items of kinds one side does
not hold at all: reported as "only in A" by kind, never as a difference in tensors. A weight that moved, a
tensor missing from a kind both sides hold, or a changed learning rate is a difference, named by its kind.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_views_fixtures import N_MODEL, trained_checkpoint
from workbench.checkpoint import diff, export
from workbench.checkpoint.diff import HYPERPARAMETER


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("diffverdict")
    step = trained_checkpoint(root / "run" / "checkpoints")
    hf = root / "hf"
    export(step, hf, to="hf", progress=False)
    hfo = root / "hf_optim"
    export(step, hfo, to="hf", include=["model", "optimizer"], progress=False)
    return {"root": root, "step": step, "hf": hf, "hf_optim": hfo}


@pytest.mark.parametrize("export_name, compared", [("hf", N_MODEL), ("hf_optim", 4 * N_MODEL)])
def test_a_checkpoint_and_its_own_export_are_not_different(ckpt, export_name, compared):
    d = diff(ckpt["step"], ckpt[export_name], progress=False)
    assert d.n_differ == 0 and len(d.values) == compared  # 48 weights, or 192 tensors with the moments
    assert d.verdict == "equal" and d.differ_kinds() == []
    assert d.added == [] and d.removed == [] and d.changed.empty
    assert {"rng", "sched", "extra"} <= set(d.only_in_a) and d.only_in_b == {}
    if export_name == "hf":  # no optimizer at all in a weights-only export: only in A, by kind
        assert {"optimizer exp_avg", "optimizer exp_avg_sq", "optimizer step", HYPERPARAMETER} <= set(d.only_in_a)
        assert d.hyperparameter_changes().empty  # not "lr: 0.003 -> None (48 params)"
    banner = d.banner()
    assert banner.startswith(f"tensors equal: {compared} of {compared} compared") and "different" not in banner
    assert "only in A:" in banner and "rng" in banner
    doc = d.to_dict()
    assert doc["verdict"] == "equal" and doc["banner"] == banner and doc["differ_kinds"] == []
    assert doc["only_in_a"]["rng"] == 3 and doc["only_in_b"] == {}


def test_the_server_answer_and_the_cli_say_the_same(ckpt, capsys):
    from workbench.cli import main
    from workbench.jupyter import checkpoints

    root = ckpt["root"]
    ans = checkpoints.diff_answer(root, ckpt["step"], ckpt["hf_optim"])
    assert ans["verdict"] == "equal" and ans["banner"].startswith("tensors equal: 192 of 192 compared")
    assert ans["n_removed"] == 0 and ans["n_added"] == 0
    assert main(["ckpt", "diff", str(ckpt["step"]), str(ckpt["hf_optim"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "equal" and doc["banner"] == ans["banner"]
    assert main(["ckpt", "diff", str(ckpt["step"]), str(ckpt["hf"])]) == 0
    out = capsys.readouterr().out
    assert "tensors equal: 48 of 48 compared" in out and "\n  - " not in out  # no "removed" key lists
    assert "-> None" not in out


def test_different_names_the_kinds_that_differ(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    # the export with one weight moved and one dropped: model differs, nothing else
    moved = tmp_path / "moved.safetensors"
    export(ckpt["step"], moved, to="safetensors", progress=False)
    t = load_file(str(moved))
    key = next(k for k in t if k.endswith("layers.1.attention.wo.weight"))
    t[key] = t[key] + 0.25
    del t[next(k for k in t if k.endswith("layers.2.ffn_norm.weight"))]
    save_file(t, str(moved))
    d = diff(ckpt["step"], moved, progress=False)
    assert d.verdict == "different" and d.differ_kinds() == ["model"]
    assert len(d.removed) == 1 and d.removed[0].endswith("layers.2.ffn_norm.weight")  # within a kind B holds
    banner = d.banner()
    assert banner.startswith("different: model (1 of 47 values differ, 1 only in A)"), banner
    assert "only in A: " in banner and "optimizer exp_avg" in banner  # the kinds B's format has none of

    # another training step: the weights, the moments and the step counters move; a changed learning
    # rate is a difference too (not a tensor: named as the hyper-parameters' kind)
    later = trained_checkpoint(tmp_path / "later" / "checkpoints", steps=2, lr=1e-3)
    d = diff(ckpt["step"], later, progress=False)
    kinds = d.differ_kinds()
    assert d.verdict == "different"
    assert {"model", "optimizer exp_avg", "optimizer exp_avg_sq", "optimizer step", "sched", "extra",
            HYPERPARAMETER} <= set(kinds), kinds
    assert d.banner().startswith("different: model (") and HYPERPARAMETER in d.banner()
    assert d.only_in_a == {} and d.only_in_b == {}


def test_identical_and_metadata_only_verdicts(ckpt):
    same = diff(ckpt["step"], ckpt["step"], progress=False)
    assert same.verdict == "identical" and same.identical and same.banner().startswith("identical: ")
    meta = diff(ckpt["step"], ckpt["hf_optim"], values=False, progress=False)
    assert meta.verdict == "not compared" and "values not compared" in meta.banner()
    assert "different" not in meta.banner()
    assert torch.__version__  # (torch imported for the fixtures' writer)
