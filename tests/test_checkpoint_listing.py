"""What the checkpoint tools show a person: param groups folded, diffs ranked per tensor kind and filtered
by kind, log-scale histograms, binary units. Real checkpoints written by ``workbench.checkpoint.save``
(the trainer's writer) from a small two-group AdamW with a decaying learning rate, in both storage formats
of the hyper-parameters: packed (``optim.hyper.<digest>``, JSON; what saves write now) and per key (one
0-d/1-d tensor per parameter and hyper-parameter, as saves wrote them before the packing).
"""

from __future__ import annotations

import json
import re
import warnings
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn

from workbench.checkpoint import TrainState, diff, export, inspect, param_groups, save, tensor_stats
from workbench.checkpoint.param_groups import describe_groups, listing

SPREAD = [0.0] + [10.0 ** e for e in range(-12, -1)]  # zero, then 1e-12 ... 1e-2: eleven decades


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 8, bias=False)
        self.register_buffer("spread", torch.tensor(SPREAD, dtype=torch.float64))  # known magnitudes

    def forward(self, x):
        return self.out(self.norm(self.proj(x)))


def _optimizer(model: Small) -> torch.optim.Optimizer:
    """Two groups, as trainers set them up: decay on matrices, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95))


def save_small_run(root: Path, steps: int = 2) -> list[Path]:
    """``root/checkpoints/step-00000{1..steps}`` written by the workbench saver; lr halves, then thirds."""
    model = Small()
    opt = _optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = TrainState(model, opt, sched, None, rank=0)
    g = torch.Generator().manual_seed(0)
    paths = []
    for step in range(1, steps + 1):
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.step = step
        paths.append(save(root / "checkpoints", state))
    return paths


def save_small_run_per_key(root: Path, steps: int = 2) -> list[Path]:
    """:func:`save_small_run` as saves wrote it before the hyper-parameters were packed: one 0-d/1-d tensor
    per parameter and hyper-parameter (``optim.param_groups.<fqn>.<name>``)."""
    import workbench.checkpoint.state as state_module
    from workbench.checkpoint.state import encode_hyper

    with pytest.MonkeyPatch.context() as m:
        m.setattr(state_module, "encode_optim",
                  lambda osd: {k: t for k, v in osd.items() if (t := encode_hyper(v)) is not None})
        return save_small_run(root, steps)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> list[Path]:
    """The two steps, hyper-parameters packed (what saves write now)."""
    return save_small_run(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def old_run(tmp_path_factory) -> list[Path]:
    """The same two steps, hyper-parameters per key (what saves wrote before the packing)."""
    return save_small_run_per_key(tmp_path_factory.mktemp("small_per_key"))


@pytest.fixture(params=["packed", "per-key"])
def either(request) -> tuple[str, list[Path]]:
    """``(format, steps)``: each test that takes it runs on both storage formats."""
    return request.param, request.getfixturevalue("run" if request.param == "packed" else "old_run")


def _main(capsys, *args):
    from workbench.cli import main

    capsys.readouterr()
    rc = main(["ckpt", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------------------------------
# param groups
# --------------------------------------------------------------------------------------------------

def test_hyperparameters_fold_into_one_row_per_param_group(either):
    fmt, steps = either
    m = inspect(steps[0])
    if fmt == "packed":  # one JSON item holds every parameter's values
        hyper_keys = [k for k in m.keys if k.startswith("optim.hyper.")]
        assert len(hyper_keys) == 1 and not any(".param_groups." in k for k in m.keys)
    else:
        hyper_keys = [k for k in m.keys if ".param_groups." in k]
        assert len(hyper_keys) == 5 * 10  # 5 parameters x lr, betas, eps, weight_decay, ... (0-d/1-d tensors)
    n = len(hyper_keys)
    s = m.summary()
    assert s["n_hyperparameters"] == n and s["n_tensors"] == len(m.tensors()) - n
    assert s["n_packed_hyperparameter_items"] == (1 if fmt == "packed" else 0)
    # the manifest reads no values: it counts what is stored, and says which
    words = ("optimizer hyper-parameters packed in 1 JSON item" if fmt == "packed"
             else "50 optimizer hyper-parameter entries")
    assert f"{s['n_tensors']} tensors + {words}" in m._repr_html_()

    groups = {g.hyper["weight_decay"]: g for g in param_groups(m)}
    assert set(groups) == {0.1, 0.0}
    decay, rest = groups[0.1], groups[0.0]
    assert sorted(decay.params) == ["out.weight", "proj.weight"]
    assert sorted(rest.params) == ["norm.bias", "norm.weight", "proj.bias"]
    for g in (decay, rest):
        assert g.values_read and g.hyper["lr"] == pytest.approx(5e-3) and g.hyper["betas"] == (0.9, 0.95)
        assert g.hyper["eps"] == 1e-8 and g.hyper["initial_lr"] == 1e-2 and g.hyper["amsgrad"] is False
        assert g.n_values == 10 * len(g.params) and g.packed == (fmt == "packed")
        assert g.to_dict()["n_values"] == 10 * len(g.params)
        if fmt == "packed":  # both groups share the one item
            assert g.keys == hyper_keys and g.storage() == f"packed in {hyper_keys[0]} (JSON)"
        else:
            assert len(g.keys) == 10 * len(g.params) and g.storage() == f"{10 * len(g.params)} entries"
    assert decay.label().startswith("lr=0.005, betas=(0.9, 0.95), eps=1e-08, weight_decay=0.1")
    assert decay.label().endswith("(2 params)") and rest.label().endswith("(3 params)")
    assert describe_groups([decay, rest]) == "50 optimizer hyper-parameter values in 2 param groups"

    rows = listing(m)
    assert not any(".param_groups." in k and k.count(".") > 2 for k in rows["key"])
    assert sorted(k for k in rows["key"] if "param_groups" in k) == ["optim.param_groups.0", "optim.param_groups.1"]
    assert len(rows) == len(m) - n + 2


def test_pickled_hyperparameters_are_named_never_unpickled(tmp_path):
    """A plain dcp.save stores Python floats pickled: listed by name, one group, values not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = Small()
    opt = _optimizer(model)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": dict(msd), "optim": osd}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    m = inspect(tmp_path / "plain")
    (g,) = param_groups(m)
    assert not g.values_read and g.n_params == 5 and set(g.hyper) >= {"lr", "betas", "weight_decay"}
    assert g.describe().startswith("lr, betas, eps, weight_decay") and "(values pickled, not read)" in g.label()
    assert m.summary()["n_hyperparameters"] == len(g.keys)


def test_cli_inspect_lists_param_groups_and_iec_sizes(capsys, either):
    fmt, run = either
    rc, out, _ = _main(capsys, "inspect", run[1], "--all")
    assert rc == 0
    m = inspect(run[1])
    n = m.summary()["n_tensors"]
    # values (a parameter's one hyper-parameter), the same count whatever the storage
    assert f"{n} tensors + 50 optimizer hyper-parameter values in 2 param groups" in out
    group_lines = [ln for ln in out.splitlines() if ln.startswith("optim.param_groups.")]
    assert len(group_lines) == 2 and not any(".lr " in ln for ln in out.splitlines())
    assert not any(ln.startswith("optim.hyper.") for ln in out.splitlines())  # folded into the groups
    decay = next(ln for ln in group_lines if "weight_decay=0.1" in ln)
    assert "lr=0.00333333" in decay and "betas=(0.9, 0.95)" in decay and "(2 params)" in decay
    (packed,) = [k for k in m.keys if k.startswith("optim.hyper.")] or [None]
    assert decay.endswith(f"[packed in {packed} (JSON)]" if fmt == "packed" else "[20 entries]")
    # sizes in binary units: 16x16 float32 is 1.00 KiB, a 0-d step counter 4 B
    assert re.search(r"^model\.proj\.weight +model +float32 +16x16 +1\.00 KiB ", out, re.M)
    assert re.search(r"^optim\.state\.proj\.weight\.step .* 4 B ", out, re.M)
    assert not re.search(r"\d ?(kB|KB|MB|GB)\b", out)

    rc, out, _ = _main(capsys, "inspect", run[1], "--filter", "proj.bias")
    keys = [ln.split()[0] for ln in out.splitlines()[4:] if ln.strip()]
    assert "model.proj.bias" in keys and "optim.state.proj.bias.exp_avg" in keys
    (group,) = [ln for ln in out.splitlines() if ln.startswith("optim.param_groups.")]  # the one holding proj.bias
    assert "weight_decay=0," in group and "(3 params)" in group

    rc, out, _ = _main(capsys, "inspect", run[1], "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["summary"]["n_param_groups"] == 2 and doc["summary"]["n_hyperparameter_values"] == 50
    # stored entries: the one packed item, or one per value
    assert doc["summary"]["n_hyperparameters"] == (1 if fmt == "packed" else 50)
    assert sorted(g["hyper"]["weight_decay"] for g in doc["param_groups"]) == [0.0, 0.1]
    assert {g["n_params"] for g in doc["param_groups"]} == {2, 3}
    assert {g["n_values"] for g in doc["param_groups"]} == {20, 30}
    assert [g["hyper"]["lr"] for g in doc["param_groups"]] == [pytest.approx(1e-2 / 3)] * 2
    assert len(doc["tensors"]) == doc["summary"]["n_entries"]  # --json keeps every entry
    # --filter keeps the group that holds the parameter, as the listing does (packed: by its parameters)
    rc, out, _ = _main(capsys, "inspect", run[1], "--json", "--filter", "proj.bias")
    (group,) = json.loads(out)["param_groups"]
    assert rc == 0 and "proj.bias" in group["params"] and group["hyper"]["weight_decay"] == 0.0


def test_cli_inspect_piped_into_head_ends_quietly(run, workbench_cli):
    """`workbench ckpt inspect RUN | head`: the reader is gone before the listing is written; exit 0, no error."""
    import subprocess

    proc = subprocess.Popen([*workbench_cli, "ckpt", "inspect", str(run[1]), "--all"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # like head after its lines, but before the first write: every write hits EPIPE
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and b"error" not in err and b"Traceback" not in err, err.decode()[-2000:]


# --------------------------------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------------------------------

def test_diff_ranks_every_tensor_kind(either):
    fmt, run = either
    d = diff(run[0], run[1], progress=False)
    overall = d.top(3, per_kind=False)
    assert set(overall["kind"]) == {"optimizer"}  # the moments move most, relative to their norm ...
    top = d.top(2)
    kinds = list(dict.fromkeys(top["tensor_kind"]))
    assert kinds[0] == "model" and {"optimizer exp_avg", "optimizer exp_avg_sq", "optimizer step"} <= set(kinds)
    model = top[top["tensor_kind"] == "model"]  # ... yet the weights that moved most are ranked too
    assert len(model) == 2 and model["rel_norm"].is_monotonic_decreasing and (model["rel_norm"] > 0).all()
    assert "model.spread" not in set(top["key"])  # a buffer that did not change is no "change"
    assert not (top["tensor_kind"] == "optimizer hyper-parameter").any()
    # hyper-parameters are no tensor values, whatever their storage: the packed item's JSON bytes are never
    # compared as numbers, per-key entries are not counted among the values either
    assert not any(k.startswith("optim.hyper.") or ".param_groups." in k for k in d.values["key"])
    assert not any(k.startswith("optim.hyper.") for k in d.added + d.removed + list(d.changed["key"]))
    by = d.by_tensor_kind().set_index("tensor_kind")
    assert (by.loc["model", "compared"], by.loc["model", "changed"]) == (6, 5)
    assert "optimizer hyper-parameter" not in by.index and len(d.values) == 30
    assert d.hyper_status == "values" and len(d.hyper) == 50 and d.n_hyper_differ == 5  # one lr per parameter
    assert (len(d.packed["a"]), len(d.packed["b"])) == ((1, 1) if fmt == "packed" else (0, 0))
    (lr,) = d.hyperparameter_changes().itertuples(index=False)  # 50 values, one fact
    assert lr.name == "lr" and lr.a == pytest.approx(5e-3) and lr.b == pytest.approx(1e-2 / 3) and lr.params == 5
    assert d.summary_line().startswith("0 added, 0 removed, 0 changed shape/dtype, 24 of 30 values differ, "
                                       "5 of 50 hyper-parameter values differ")
    assert ("optim.hyper.* JSON, decoded and compared per parameter" in d.summary_line()) == (fmt == "packed")
    doc = d.to_dict()
    assert doc["hyperparameters"]["n_differ"] == 5 and doc["hyperparameters"]["n_compared"] == 50
    assert not d.identical and diff(run[1], run[1], progress=False).identical


def test_diff_across_the_two_storage_formats(run, old_run):
    """A checkpoint written before the packing diffs against one written after it, value by value: the
    same state is identical, and a changed learning rate is the one hyper-parameter change."""
    same = diff(old_run[1], run[1], progress=False)
    assert same.identical and not same.added and not same.removed and same.n_differ == 0
    assert len(same.hyper) == 50 and same.n_hyper_differ == 0 and same.hyperparameter_changes().empty
    for a, b in ((old_run[0], run[1]), (run[0], old_run[1])):
        d = diff(a, b, progress=False)
        assert not d.added and not d.removed and d.changed.empty
        (lr,) = d.hyperparameter_changes().itertuples(index=False)
        assert (lr.name, lr.a, lr.b, lr.params) == ("lr", pytest.approx(5e-3), pytest.approx(1e-2 / 3), 5)


def test_diff_without_values_says_what_it_knows_of_the_hyperparameters(capsys, run, old_run):
    """Metadata only: a packed item is named by the digest of its content, so equal names are equal values;
    per-key entries of the same names tell nothing. The item is never a 'changed shape/dtype' key."""
    d = diff(run[0], run[1], values=False, progress=False)
    assert d.hyper_status == "differ" and d.changed.empty and not d.identical and d.hyper.empty
    assert "optimizer hyper-parameters differ (other optim.hyper.* items" in d.summary_line()
    same = diff(run[1], run[1], values=False, progress=False)
    assert same.hyper_status == "same" and same.identical
    for a, b in ((old_run[0], old_run[1]), (old_run[0], run[1])):
        d = diff(a, b, values=False, progress=False)
        assert d.hyper_status == "not compared" and not d.added and not d.removed and d.changed.empty
        assert "optimizer hyper-parameters not compared (values not read)" in d.summary_line()
    rc, out, _ = _main(capsys, "diff", run[0], run[1], "--no-values")
    assert rc == 0 and "0 changed shape/dtype, optimizer hyper-parameters differ" in out and "~" not in out


def test_diff_kind_filter_in_the_core_and_the_cli(capsys, either):
    fmt, run = either
    d = diff(run[0], run[1], kinds=["model"], progress=False)
    assert d.kinds == ["model"] and set(d.values["kind"]) == {"model"} and d.hyperparameter_changes().empty
    assert set(diff(run[0], run[1], progress=False).top(5, kind="optim")["kind"]) == {"optimizer"}

    rc, out, _ = _main(capsys, "diff", run[0], run[1], "--kind", "model", "--top", "2")
    assert rc == 0 and "5 of 6 values differ (kinds: model)" in out and "  model: 5 of 6 changed" in out
    assert "optim" not in out and "hyper" not in out
    rc, out, _ = _main(capsys, "diff", run[0], run[1], "--top", "1")
    assert rc == 0 and "  model: 5 of 6 changed" in out and "  optimizer exp_avg_sq: 5 of 5 changed" in out
    assert "optimizer hyper-parameters changed:\n  lr: 0.005 -> 0.00333333 (5 params)\n" in out
    assert "24 of 30 values differ, 5 of 50 hyper-parameter values differ" in out
    assert not re.search(r"optim\.hyper\.[0-9a-f]", out)  # the packed item is never ranked as a tensor
    rc, out, _ = _main(capsys, "diff", run[0], run[1], "--kind", "Optim", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["kinds"] == ["optimizer"] and {r["kind"] for r in doc["top_changes"]} == {"optimizer"}
    (lr,) = doc["hyperparameter_changes"]
    assert lr["name"] == "lr" and lr["a"] == pytest.approx(5e-3) and lr["b"] == pytest.approx(1e-2 / 3)
    assert lr["params"] == 5 and doc["hyperparameters"]["n_differ"] == 5
    rc, _, err = _main(capsys, "diff", run[0], run[1], "--kind", "grads")
    assert rc == 2 and "unknown kind 'grads'" in err


class _Text(HTMLParser):
    """The text nodes of an HTML fragment, in order (what a browser's textContent concatenates)."""

    def __init__(self):
        super().__init__()
        self.nodes: list[str] = []

    def handle_data(self, data: str) -> None:
        self.nodes.append(data)


def test_diff_html_keeps_words_apart(either):
    _, run = either
    d = diff(run[0], run[1], progress=False)
    page = d._repr_html_()
    parser = _Text()
    parser.feed(page)
    glued = [(a[-20:], b[:20]) for a, b in zip(parser.nodes, parser.nodes[1:])
             if a and b and a[-1].isalnum() and b[0].isalnum()]
    assert glued == []
    text = "".join(parser.nodes)
    assert "values differ" in text and "largest value changes per tensor kind" in text
    assert "lr: 0.005 \u2192 0.00333333 (5 params)" in text and "5 of 50 hyper-parameter values differ" in text


# --------------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------------

def test_log_histogram_spreads_what_a_linear_one_lumps(capsys, run):
    lin = tensor_stats(run[0], "model.spread", bins=11)["histogram"]
    assert lin["scale"] == "linear" and lin["counts"][0] == 10  # ten of twelve values in the first bin
    s = tensor_stats(run[0], "model.spread", bins=11, log=True)
    h = s["histogram"]
    assert h["scale"] == "log10|x|" and h["counts"] == [1] * 11 and h["excluded"] == 1 == s["zeros"]
    assert h["centers"][0] == pytest.approx(-12 + 5 / 11) and h["centers"][-1] == pytest.approx(-2 - 5 / 11)
    assert s["min"] == 0.0 and s["max"] == pytest.approx(1e-2)  # the statistics are not logged

    rc, out, _ = _main(capsys, "stats", run[0], "model.spread", "--bins", "11", "--log")
    assert rc == 0 and "histogram of log10 |x| (11 bins, 1 zero(s) left out)" in out
    assert len([ln for ln in out.splitlines() if ln.rstrip().endswith(" 1") and "#" in ln]) == 11
    rc, out, _ = _main(capsys, "stats", run[0], "model.spread", "--bins", "4", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["histogram"]["scale"] == "linear" and sum(doc["histogram"]["counts"]) == 12
    rc, _, err = _main(capsys, "stats", run[0], "model.sprad")
    assert rc == 2 and "did you mean" in err


def test_stats_of_packed_hyperparameters_points_to_inspect(capsys, run, old_run):
    """An optim.hyper.* item is a uint8 tensor of JSON: no statistics of its bytes, one line saying so."""
    (key,) = [k for k in inspect(run[0]).keys if k.startswith("optim.hyper.")]
    with pytest.raises(ValueError, match="packed optimizer hyper-parameters"):
        tensor_stats(run[0], key)
    rc, out, err = _main(capsys, "stats", run[0], key)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: '{key}' is packed optimizer hyper-parameters (UTF-8 JSON") and "ckpt inspect" in err
    # a per-key hyper-parameter is a number: its statistics are its value
    s = tensor_stats(old_run[0], "optim.param_groups.proj.weight.lr")
    assert s["numel"] == 1 and s["dtype"] == "float64" and s["mean"] == pytest.approx(5e-3)


def test_log_histogram_of_fp8_tensors(tmp_path):
    from test_checkpoint_fp8 import FP8Weights

    model = FP8Weights(0)
    save(tmp_path / "checkpoints", TrainState(model=model, step=1))
    x = model.w.float()
    finite = x[x.isfinite()]
    s = tensor_stats(tmp_path / "checkpoints" / "step-000001", "model.w", bins=8, log=True)
    h = s["histogram"]
    assert s["dtype"] == "float8_e4m3fn" and s["non_finite"] == 1
    assert sum(h["counts"]) + h["excluded"] == finite.numel() and h["excluded"] == int((finite == 0).sum())
    nz = finite[finite != 0].abs().double().log10()
    assert h["centers"][0] - h["width"] / 2 == pytest.approx(float(nz.min()))


# --------------------------------------------------------------------------------------------------
# units
# --------------------------------------------------------------------------------------------------

def test_sizes_are_binary_units(run, tmp_path):
    import inspect as pyinspect

    from workbench.checkpoint.formats import parse_size

    m = inspect(run[0])
    result = export(m, tmp_path / "w.safetensors", to="safetensors", progress=False)
    assert re.search(r"\(\d+\.\d\d KiB\)", result._repr_html_())
    assert "optimizer hyper-parameters packed in 1 JSON item" in m._repr_html_() and "KiB" in m._repr_html_()
    assert pyinspect.signature(export).parameters["max_shard_size"].default == "2GiB"
    assert parse_size("2GiB") == 2 ** 31 and parse_size("2GB") == 2 * 10 ** 9  # HF's decimal still accepted
