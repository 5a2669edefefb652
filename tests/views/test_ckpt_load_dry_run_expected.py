"""Issue 28, finding 11: a load dry run does not call the optimizer's hyper-parameters "unexpected".

Every checkpoint ``workbench train`` writes holds its AdamW hyper-parameters packed in one
``optim.hyper.<digest>`` item (older saves: ``optim.param_groups.<fqn>.<name>`` entries). A resume loads
them into the optimizer's param groups: they are expected state, like the RNG and scheduler entries. Keys
the target really does not use (another model's layer) are still listed.
"""

from __future__ import annotations

import pytest

from ckpt_views_fixtures import trained_checkpoint
from workbench.checkpoint import inspect, plan_load


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    return trained_checkpoint(tmp_path_factory.mktemp("dryrun") / "checkpoints")


def test_packed_hyperparameters_are_not_unexpected(step):
    (item,) = [k for k in inspect(step).keys if k.startswith("optim.hyper.")]
    for layout in ("tp=2", "dp_shard=2", "dp_shard=1"):
        p = plan_load(step, layout)
        assert p.loadable and p.unexpected == [], (layout, p.unexpected)
        assert "does not use" not in p._repr_html_()
    assert plan_load(step, "tp=2", full_state=False).unexpected == []  # weights only: optim.* is not asked
    assert item  # (the item is there: it is what the old dry run listed)


def test_the_server_answer_lists_no_hyperparameters(step):
    from workbench.jupyter import checkpoints

    ans = checkpoints.plan_load_answer(step.parent.parent, step, {"tp": "2"})
    assert ans["loadable"] and ans["n_unexpected"] == 0 and ans["unexpected"] == []


def test_keys_of_another_model_are_still_unexpected(step):
    import dataclasses

    from workbench.config import PRESETS

    tiny = PRESETS["tiny"]
    p = plan_load(step, "dp_shard=1", model=dataclasses.replace(tiny, n_layers=tiny.n_layers - 1))
    assert f"model.layers.{tiny.n_layers - 1}.attention.wq.weight" in p.unexpected
    assert not any(k.startswith("optim.hyper.") or ".param_groups." in k for k in p.unexpected)


def test_quantized_moments_are_the_moments_the_target_needs(tmp_path):
    """``--ckpt-quant int8`` stores a moment as ``<key>.q`` + ``<key>.qscale``, and a resume dequantizes them
    into ``<key>``: neither "missing" (the moment) nor "unexpected" (its codes and scales)."""
    q = trained_checkpoint(tmp_path / "checkpoints", quant="int8")
    m = inspect(q)
    assert m.quant and any(k.endswith(".exp_avg.q") for k in m.keys)
    p = plan_load(q, "tp=2")
    assert p.loadable and p.missing == [] and p.unexpected == [], (p.missing[:3], p.unexpected[:3])
    assert p.checked == plan_load(q, "tp=2", full_state=False).checked + 3 * 48  # every moment and step
    assert any("quantized" in n and "int8" in n for n in p.notes), p.notes
    assert not p.dtype_changes
