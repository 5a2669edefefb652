"""The embedding trainer end to end: real gloo ranks under torchrun, checkpoints, resume in another layout,
and the command line's refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest

from workbench.cli import main as cli_main
from workbench.config import PRESETS
from workbench.embedding.trainer import train_embedding

# two blocks of the tiny preset: the same code path, a quarter of the time
MODEL = dataclasses.asdict(dataclasses.replace(PRESETS["tiny"], name="tiny-2l", n_layers=2, max_seq_len=64))
FAST = dict(global_batch=32, lr=1e-3, warmup_steps=20, seq_len=64, progress=False)


def test_two_ranks_with_gathered_negatives_learn_retrieval(tmp_path):
    """dp_shard=2 with GradCache chunks of 8: held-out top-1 retrieval rises well above where it starts and
    far above chance within 60 steps (about 25 s on 2 cores)."""
    run = train_embedding(MODEL, out=tmp_path / "run", dp_shard=2, chunk=8, steps=60, eval_every=30,
                          timeout_s=240, **FAST)
    ev = run.evals
    assert list(ev["step"]) == [0, 30, 60]
    start, end = float(ev["retrieval_accuracy"].iloc[0]), run.accuracy
    assert run.chance == 1 / 200
    assert end >= start + 0.25 and end >= 40 * run.chance, ev.to_string()
    m = run.metrics
    assert sorted(m["rank"].unique()) == [0, 1] and len(m) == 120
    first, last = m[m["rank"] == 0]["loss"].iloc[:5].mean(), m[m["rank"] == 0]["loss"].iloc[-5:].mean()
    assert last < 0.6 * first, (first, last)
    # ranks report the same (all-reduced) loss: one data-parallel step, not two
    assert (m[m["rank"] == 0]["loss"].values == m[m["rank"] == 1]["loss"].values).all()
    assert json.loads(run.to_json())["steps"] == 60 and "top-1" in run._repr_html_()


def test_resume_continues_exactly_and_in_another_layout(tmp_path):
    """A run resumed from its step-3 checkpoint repeats the uninterrupted run's losses bit for bit (one
    rank); resumed under tp=2 from the same checkpoint they agree to float rounding, and the resume event
    names the layout change."""
    kw = dict(FAST, global_batch=8, eval_every=0, dropout=0.1, hard_gap=2)
    full = train_embedding(MODEL, out=tmp_path / "full", steps=6, ckpt_every=3, **kw)
    ref = full.metrics["loss"].tolist()
    ckpt = tmp_path / "full" / "checkpoints" / "step-000003"
    assert ckpt.is_dir()
    again = train_embedding(MODEL, out=tmp_path / "again", steps=6, resume=str(ckpt), **kw)
    assert again.metrics["step"].tolist() == [3, 4, 5]
    assert again.metrics["loss"].tolist() == ref[3:]
    # refused before anything starts, in one line: another head, a directory that holds a run
    with pytest.raises(ValueError, match="does not fit this model: it has no model.encoder.projection.weight"):
        train_embedding(MODEL, out=tmp_path / "proj", steps=6, resume=str(ckpt), projection=32, **kw)
    with pytest.raises(ValueError, match="already holds a run"):
        train_embedding(MODEL, out=tmp_path / "full", steps=6, **kw)
    assert not (tmp_path / "proj").exists() and len(full.metrics) == 6
    tp = train_embedding(MODEL, out=tmp_path / "tp", steps=6, resume=str(ckpt), tp=2, timeout_s=240, **kw)
    got = tp.metrics[tp.metrics["rank"] == 0]["loss"].tolist()
    assert got == pytest.approx(ref[3:], rel=1e-4)
    resume = next(e for e in tp.events if e["type"] == "resume" and e["rank"] == 0)
    assert resume["step"] == 3 and resume["layout_changed"] and resume["layout_desc"] == "tp=2"
    assert resume["layout_changes"] == {"tp": [1, 2]}


@pytest.mark.parametrize("args, message", [
    (["--pp", "2"], "without pipeline stages"),
    (["tiny-moe"], "mixture of experts"),
    (["--matryoshka", "64,512"], "exceed the embedding size 128"),
    (["--matryoshka", "64,x"], "comma-separated sizes"),
    (["--micro-batch", "2"], "use --chunk"),
    (["--dp-shard", "2", "--global-batch", "7"], "not divisible by the 2 data-parallel ranks"),
    (["--held-out", "2000"], "held_out=2000 must be in"),
    (["--task", "paraphrase"], "task"),
    (["--global-batch", "5000"], "exceeds the"),
])
def test_cli_refuses_bad_settings_in_one_line(args, message, capsys, tmp_path):
    try:
        code = cli_main(["train-embedding", *args, "--out", str(tmp_path / "x"), "--json"])
    except SystemExit as e:  # argparse's own refusals (a bad choice) exit from the parser
        code = e.code
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["status"] == "error" and message in out["error"], out
    assert "\n" not in out["error"]
    assert not (tmp_path / "x").exists()  # refused before anything was created


def test_cli_trains_and_reports_json(capsys, tmp_path):
    code = cli_main(["train-embedding", "--steps", "2", "--global-batch", "8", "--seq-len", "32",
                     "--eval-every", "0", "--out", str(tmp_path / "r"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["status"] == "succeeded" and out["steps"] == 2
    assert [e["step"] for e in out["evals"]] == [2] and 0 <= out["evals"][0]["retrieval_accuracy"] <= 1


def test_ddp_with_a_learned_head_trains_as_one_process(tmp_path):
    """dp_replicate=2 (DDP over the backbone; the projection and learned temperature averaged by hand) with
    Matryoshka sizes and GradCache chunks logs the losses of one process with the whole batch."""
    kw = dict(FAST, global_batch=8, steps=3, eval_every=0, projection=64, learn_temperature=True,
              matryoshka="64,32")
    one = train_embedding(MODEL, out=tmp_path / "one", **kw)
    ddp = train_embedding(MODEL, out=tmp_path / "ddp", dp_replicate=2, chunk=2, timeout_s=240, **kw)
    ref = one.metrics["loss"].tolist()
    m = ddp.metrics
    assert m[m["rank"] == 0]["loss"].tolist() == pytest.approx(ref, rel=1e-5)
    assert m[m["rank"] == 0]["temperature"].tolist() == pytest.approx(one.metrics["temperature"].tolist(), rel=1e-5)
    assert one.metrics["temperature"].iloc[-1] != 0.05  # learned: it moved
