"""The torch-compat layer, explicit SPMD installation and `workbench doctor`.

A missing private torch API is simulated through the real detection path: ``WORKBENCH_COMPAT_HIDE``
makes ``workbench.compat`` treat the named symbols (or a whole feature) as absent, exactly as an older
torch that lacks them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench import compat

REPO = Path(__file__).resolve().parents[1]

_NEEDS_ALL = pytest.mark.skipif(
    not all(compat.available(f) for f in compat.FEATURES),
    reason=f"hides APIs on a torch that has every feature; torch {compat.TORCH_VERSION} already lacks some")



def _run(cmd, env_extra=None, timeout=150):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


# --------------------------------------------------------------------------------------------------
# `import workbench` changes nothing in torch
# --------------------------------------------------------------------------------------------------

# Snapshots every table DTensor's dispatch consults (op -> handler / strategy / rule / schema info).
# `same` holds when every entry torch had is still the very same object, and no entry anywhere comes
# from workbench. The script then checks that the check can fail: install() must break it, and
# uninstall() must restore it.
_SNAPSHOT_SCRIPT = r"""
import importlib.util, sys
import torch
import torch.distributed.tensor  # torch's own rules register here
# The door to DTensor's tables, loaded on its own: importing the package would run workbench's __init__.
spec = importlib.util.spec_from_file_location("wb_compat", "workbench/compat.py")
compat = sys.modules["wb_compat"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat)

TABLES = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules", "op_to_schema_info",
          "op_to_schema_info_for_single_dim_strategy")

def snapshot():
    prop = compat.sharding_propagator()
    snap = {name: dict(getattr(prop, name)) for name in TABLES}
    snap["custom_op_handlers"] = dict(compat.custom_op_handlers())
    return snap

def origin(v):
    fn = getattr(v, "func", v)
    return getattr(fn, "__module__", "") or ""

def same(before, after):
    for name, table in before.items():
        for op, v in table.items():
            if after[name].get(op) is not v:
                return f"{name}[{op}] changed"
    for name, table in after.items():
        for op, v in table.items():
            if origin(v).startswith("workbench"):
                return f"{name}[{op}] comes from {origin(v)}"
    return "same"

before = snapshot()
assert "workbench" not in sys.modules
import workbench
print(torch.nn.Linear(2, 2).weight.dtype)
assert "workbench.spmd" not in sys.modules  # the rules load on first use (tests/test_imports.py) ...
assert len(workbench.spmd.RULES) > 0 and "workbench.spmd.elementwise" in sys.modules  # ... registered, not installed
print("after import:", same(before, snapshot()))
workbench.spmd.install()
print("after install:", same(before, snapshot()))
workbench.spmd.uninstall()
print("after uninstall:", same(before, snapshot()))
"""


def test_import_workbench_leaves_dtensor_sharding_propagator_untouched():
    res = _run([sys.executable, "-c", _SNAPSHOT_SCRIPT], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0] == "torch.float32"
    assert lines[1] == "after import: same"
    assert lines[2].startswith("after install: ") and lines[2] != "after install: same"  # the check can fail
    assert lines[3] == "after uninstall: same"


def test_our_rules_is_scoped_and_restores_torch():
    from workbench import spmd

    op = next(op for op, rule in spmd.RULES.items() if rule.handler is not None)  # e.g. batch_norm
    handlers = compat.custom_op_handlers()
    torch_entry = handlers.get(op)
    assert not spmd.installed()
    with spmd.our_rules():
        assert spmd.installed() and handlers[op] is spmd.RULES[op].handler
        with spmd.our_rules():  # nested: the outer scope owns the installation
            pass
        assert spmd.installed()
    assert not spmd.installed() and handlers.get(op) is torch_entry


def test_train_config_records_spmd_rules_default_on():
    from workbench.config import TrainConfig

    assert TrainConfig().spmd_rules is True
    assert TrainConfig.from_dict(TrainConfig(spmd_rules=False).to_dict()).spmd_rules is False


# --------------------------------------------------------------------------------------------------
# Feature detection, in process
# --------------------------------------------------------------------------------------------------


def test_every_feature_is_available_on_a_supported_torch():
    # torch 2.11 describes pointwise ops without the single-dim helpers our elementwise rules extend.
    expected = {"spmd.elementwise"} if compat.TORCH_VERSION.startswith("2.11.") else set()
    # Families whose DTensor behaviour differs before a release are gated on it (norms, indexing: 2.13).
    expected |= {n for n, f in compat.FEATURES.items()
                 if f.min_torch and compat._version(compat.TORCH_VERSION) < compat._version(f.min_torch)}
    assert {f["feature"] for f in compat.report() if not f["available"]} == expected
    assert compat.get("FakeStore").__name__ == "FakeStore"
    from workbench.compat import DTensorSpec  # the short names import like module attributes

    assert DTensorSpec.__name__ == "DTensorSpec"


@_NEEDS_ALL
def test_hidden_symbol_is_missing_through_the_detection_path(monkeypatch, capsys):
    monkeypatch.setenv(compat.HIDE_ENV, "_sorted_batch_p2p")
    with pytest.raises(compat.MissingTorchAPI, match=r"torch \S+ lacks torch\.distributed\.pipelining\.schedules:_sorted_batch_p2p"):
        compat.get("sorted_batch_p2p")
    assert compat.missing("pipeline.lean_schedule") == ["torch.distributed.pipelining.schedules:_sorted_batch_p2p"]
    why = compat.skip_reason("pipeline.lean_schedule")
    assert why.startswith(f"torch {compat.TORCH_VERSION} lacks ") and "hidden by WORKBENCH_COMPAT_HIDE" in why
    assert compat.available("spmd.norms")  # only what needs it is affected
    compat._warned.discard("pipeline.lean_schedule")
    assert compat.check("pipeline.lean_schedule") is False and compat.check("pipeline.lean_schedule") is False
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"workbench: pipeline schedule 'GPipeLean' skipped: {why}"]  # one line, once


@_NEEDS_ALL
def test_hidden_feature_requires_are_followed(monkeypatch):
    monkeypatch.setenv(compat.HIDE_ENV, "spmd.reductions")
    assert not compat.available("spmd.reductions")
    assert compat.missing("spmd.indexing") == ["feature spmd.reductions"]
    assert not compat.available("spmd.norms") and compat.available("spmd.comm")


def test_gpipe_lean_refused_in_one_line_when_its_helpers_are_missing(monkeypatch):
    from workbench.config import PRESETS, ParallelConfig, validate

    tiny, lean = PRESETS["tiny"], ParallelConfig(pp=2, pp_schedule="GPipeLean")
    validate(tiny, lean)
    monkeypatch.setenv(compat.HIDE_ENV, "_wait_batch_p2p")
    with pytest.raises(ValueError) as e:
        validate(tiny, lean)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("pp_schedule='GPipeLean' is unavailable: torch ")
    assert msg.endswith("choose pp_schedule='GPipe'")
    validate(tiny, ParallelConfig(pp=2, pp_schedule="GPipe"))


def test_settings_that_need_a_missing_api_are_refused_and_the_rest_degrades(monkeypatch):
    from workbench.config import PRESETS, ParallelConfig, TrainConfig, validate
    from workbench.memory.probe import PeakMemoryProbe
    from workbench.plan import plan

    monkeypatch.setenv(compat.HIDE_ENV, "checkpoint_wrapper,_get_fqns,FakeStore,TorchDispatchMode")
    tiny, one = PRESETS["tiny"], ParallelConfig(dp_shard=1)
    validate(tiny, one, TrainConfig())  # a job that needs none of them is still valid
    for train, start, fix in [(TrainConfig(activation_checkpointing="full"), "activation_checkpointing='full' is "
                               "unavailable: torch", "(--ac none)"),
                              (TrainConfig(ema=0.9, ckpt_every=1), "ema=0.9 is unavailable: torch", "(--ema 0)")]:
        with pytest.raises(ValueError) as e:
            validate(tiny, one, train)
        assert "\n" not in str(e.value) and str(e.value).startswith(start) and str(e.value).endswith(fix)
    with pytest.raises(ValueError, match=r"^a sharding plan is unavailable: torch \S+ lacks feature plan.fake_pg"):
        plan("tiny", ParallelConfig(tp=2))
    # The CPU memory probe needs a dispatch mode: without it it answers None, never a wrong number.
    probe = PeakMemoryProbe("cpu")
    with probe:
        torch.ones(1000)
    assert probe.measuring is False and probe.peak() is None and probe.live() is None
    monkeypatch.delenv(compat.HIDE_ENV)
    with PeakMemoryProbe("cpu") as probe:
        keep = torch.ones(1000)
    assert probe.peak() >= keep.untyped_storage().nbytes()


def test_cli_turns_a_missing_api_into_one_line(workbench_cli):
    res = _run([*workbench_cli, "plan", "tiny", "--tp", "2"], {compat.HIDE_ENV: "FakeStore"}, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        f"error: a sharding plan is unavailable: torch {compat.TORCH_VERSION} lacks feature plan.fake_pg; use a "
        "torch release that has it (2.11 to 2.13 do; `workbench doctor` lists what this one lacks)"]
    res = _run([*workbench_cli, "train", "tiny", "--ac", "full", "--json"], {compat.HIDE_ENV: "checkpoint_wrapper"},
               timeout=120)
    assert res.returncode == 2 and json.loads(res.stdout)["error"].startswith("activation_checkpointing='full' is "
                                                                             "unavailable")


# --------------------------------------------------------------------------------------------------
# With a private API hidden: import, doctor, train, ckpt inspect
# --------------------------------------------------------------------------------------------------

HIDE = {compat.HIDE_ENV: "torch.distributed.tensor._ops._pointwise_ops:_common_pointwise_single_dim_strategy,"
                         "_sorted_batch_p2p"}


@_NEEDS_ALL
def test_import_with_a_hidden_api_registers_the_other_families():
    code = ("import workbench, workbench.spmd as s; print(sorted(s.SKIPPED_FAMILIES)); "
            "print(sorted({r.family for r in s.RULES.values()}))")
    res = _run([sys.executable, "-c", code], HIDE, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    skipped, families = res.stdout.strip().splitlines()
    assert skipped == "['elementwise']"
    assert "masked" not in families and "norm" in families and "index" in families
    assert res.stderr == ""  # import alone says nothing; install() names the skipped family


@_NEEDS_ALL
def test_doctor_json_names_what_is_skipped(workbench_cli):
    res = _run([*workbench_cli, "doctor", "--json"], HIDE, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["status"] == "ok" and doc["torch"] == torch.__version__
    assert doc["skipped"] == ["spmd.elementwise", "pipeline.lean_schedule"]
    feats = {f["feature"]: f for f in doc["features"]}
    assert "_common_pointwise_single_dim_strategy" in feats["spmd.elementwise"]["why"]
    assert feats["pipeline.lean_schedule"]["if_missing"].startswith("pp_schedule='GPipeLean' is refused")
    assert feats["spmd.norms"]["available"] and doc["backends"]["gloo"] is True
    text = _run([*workbench_cli, "doctor"], HIDE, timeout=120)
    assert text.returncode == 0 and "SKIP spmd.elementwise" in text.stdout and "ok   spmd.norms" in text.stdout


@pytest.mark.timeout(300)
def test_train_and_ckpt_inspect_work_with_a_hidden_api(workbench_cli, tmp_path):
    out = tmp_path / "run"
    res = _run([*workbench_cli, "train", "tiny", "--steps", "2", "--ckpt-every", "2", "--out", str(out), "--json"],
               HIDE, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["status"] == "succeeded" and doc["steps_logged"] == 2
    assert json.loads((out / "config.json").read_text())["train"]["spmd_rules"] is True
    # The rank installed our rules, and said once which family it left out.
    logs = "".join(p.read_text() for p in out.rglob("*.log")) + res.stderr
    assert logs.count("workbench: SPMD rule family 'elementwise' skipped: torch") == 1, logs[-2000:]
    step = sorted(p for p in (out / "checkpoints").iterdir() if p.is_dir())[-1]
    res = _run([*workbench_cli, "ckpt", "inspect", str(step), "--json"], HIDE, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["status"] == "ok"
