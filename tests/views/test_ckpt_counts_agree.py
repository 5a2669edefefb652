"""Issue 28, finding 11: the tab, ``ckpt inspect --json`` and ``ckpt verify --json`` count the same tensors.

The tab showed 201 tensors and verify 202 for one checkpoint: verify counted every stored entry with a
shape, the packed optimizer hyper-parameters (``optim.hyper.<digest>``, JSON bytes in a uint8 tensor)
included, while the manifest counts those apart, as hyper-parameters. Now all three say ``n_tensors``
tensors, and verify names the hyper-parameter entries it checked beside them.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckpt_views_fixtures import N_MODEL, trained_checkpoint
from workbench.checkpoint import export


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("counts")
    step = trained_checkpoint(root / "run" / "checkpoints")
    export(step, root / "hf", to="hf", include=["model", "optimizer"], progress=False)
    export(step, root / "w.safetensors", to="safetensors", progress=False)
    # torch.save with plain values beside the tensors (what other tools save): values are no tensors
    torch.save({"model.w": torch.ones(2, 3), "model.b": torch.zeros(3), "epoch": 3, "lr": 0.1}, root / "plain.pt")
    return root, {"workbench": step, "hf": root / "hf", "safetensors": root / "w.safetensors",
                  "torch": root / "plain.pt"}


def _cli_json(capsys, *args) -> dict:
    from workbench.cli import main

    rc = main(["ckpt", *map(str, args), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0, doc
    return doc


@pytest.mark.parametrize("fmt, want", [("workbench", 201), ("hf", 4 * N_MODEL), ("safetensors", N_MODEL),
                                       ("torch", 2)])
def test_tab_inspect_and_verify_count_the_same_tensors(capsys, checkpoints, fmt, want):
    from workbench.jupyter import checkpoints as answers

    root, paths = checkpoints
    tab = answers.manifest_page(root, paths[fmt], limit=5)["summary"]["n_tensors"]  # what the tab shows
    inspected = _cli_json(capsys, "inspect", paths[fmt])["summary"]["n_tensors"]
    verified = _cli_json(capsys, "verify", paths[fmt])["checked"]["tensors"]
    served = answers.verify_answer(root, paths[fmt])["checked"]["tensors"]  # the tab's Verify
    assert tab == inspected == verified == served == want, (tab, inspected, verified, served)


def test_verify_names_the_hyperparameter_entries_beside_the_tensors(capsys, checkpoints):
    _, paths = checkpoints
    doc = _cli_json(capsys, "verify", paths["workbench"])
    summary = _cli_json(capsys, "inspect", paths["workbench"])["summary"]
    assert doc["checked"]["hyperparameter_entries"] == summary["n_hyperparameters"] == 1
    # every stored entry's chunks are checked: the tensors and the packed item
    assert doc["checked"]["chunks"] == summary["n_entries"] == 202
    deep = _cli_json(capsys, "verify", paths["workbench"], "--deep")
    assert deep["checked"]["tensors_loaded"] == 201
