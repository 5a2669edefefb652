"""The layout advisor (workbench.prediction.advise, `workbench advise`): ranked layouts that fit, with their
bounds and the reasons others were dropped; one-line refusals; the JSON document; the 70B/1024 run's time."""

from __future__ import annotations

import json

import pytest

from workbench.cli import main
from workbench.prediction.advise import RULES, advise

BOUNDS = {"memory", "compute", "communication", "bubble", "host"}


@pytest.fixture(scope="module")
def small4():
    # 2 GPUs per node so that tp=4 is pruned by the TP-within-a-node rule
    return advise("small", gpus=4, gpu_memory="4GiB", gpu="cpu", gpus_per_node=2, top=2, global_batch=8, seq_len=128)


def test_small_on_four_ranks_ranks_fitting_layouts_with_bounds_and_reasons(small4):
    ranked = small4.ranked
    assert len(ranked) == 2
    assert list(ranked["rank"]) == [1, 2]
    assert ranked["fits"].all() and (ranked["estimate"] == "predicted").all()
    assert (ranked["needed_bytes"] <= 4 << 30).all() and (ranked["peak_bytes"] > 0).all()
    assert ranked["tokens_per_s"].is_monotonic_decreasing
    assert set(ranked["bound"]) <= BOUNDS
    # every layout has 4 ranks and is named as its settings say
    for _, r in ranked.iterrows():
        assert r["dp_replicate"] * r["dp_shard"] * r["tp"] * r["pp"] == 4
        assert f"tp={r['tp']}" in r["layout"] and f"micro={r['micro']}" in r["layout"]
    frame = small4.to_frame()
    unranked = frame[frame["rank"].isna()]
    assert unranked["reason"].notna().all()  # every layout not ranked says why
    assert any(r.startswith("TP within a node: tp=4") for r in unranked["reason"])
    assert small4.best["layout"] == ranked.iloc[0]["layout"]
    front = small4.pareto()
    assert not front.empty and front.iloc[0]["layout"] in set(ranked["layout"])
    text = repr(small4)
    assert ranked.iloc[0]["layout"] in text and "tok/s/GPU" in text
    assert "<table" in small4._repr_html_()


def test_a_tiny_memory_budget_prunes_everything_and_says_so_in_one_line():
    a = advise("small", gpus=4, gpu_memory="1MiB", gpu="cpu", top=2, global_batch=8, seq_len=128)
    assert a.ranked.empty and a.best is None
    line = a.summary_line()
    assert "nothing fits" in line and "\n" not in line and "1.00 MiB" in line
    frame = a.to_frame()
    assert frame["reason"].notna().all() and not frame["fits"].fillna(False).any()
    assert a.to_dict()["nothing_fits"] == a.meta["nothing_fits"]


def test_memory_bounds_a_layout_whose_bigger_micro_batch_does_not_fit():
    tight = advise("small", gpus=4, gpu_memory="400MiB", gpu="cpu", exact=0, top=5)
    roomy = advise("small", gpus=4, gpu_memory="1GiB", gpu="cpu", exact=0, top=5)
    assert set(tight.ranked["bound"]) == {"memory"}
    assert "memory" not in set(roomy.ranked["bound"])
    frame = tight.to_frame()
    for _, r in tight.ranked.iterrows():  # a faster sibling (same degrees, bigger micro batch or less AC) is over
        same = frame[(frame["dp_replicate"] == r["dp_replicate"]) & (frame["dp_shard"] == r["dp_shard"])
                     & (frame["tp"] == r["tp"]) & (frame["pp"] == r["pp"]) & (frame["sp"] == r["sp"])]
        over = same[(same["step_time_s"] < r["step_time_s"]) & (same["fits"] == False)]  # noqa: E712
        assert not over.empty


def test_an_included_layout_the_search_does_not_hold_is_one_line():
    with pytest.raises(ValueError, match=r"^include: \{'tp': 3\} is not a layout of 4 GPUs") as e:
        advise("small", gpus=4, gpu_memory="1GiB", gpu="cpu", exact=0, include=[{"tp": 3}])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "4", "--gpu-memory", "lots"], "lots"),
    (["--gpus", "0", "--gpu-memory", "8GiB"], "gpus"),
    (["--gpus", "16", "--gpu-memory", "8GiB", "--nodes", "3"], "nodes=3"),
    (["--gpus", "12", "--gpu-memory", "8GiB"], "gpus=12"),
    (["--gpus", "4", "--gpu-memory", "8GiB", "--gpu", "Z80"], "Z80"),
    (["--gpus", "4", "--gpu-memory", "8GiB", "--seq-len", "4096"], "seq_len=4096"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, words):
    try:
        code = main(["advise", "small", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error:") and "\n" not in err and words in err
    assert "Traceback" not in err


def test_cli_json_document(capsys):
    code = main(["advise", "small", "--gpus", "4", "--gpu-memory", "2GiB", "--gpu", "cpu", "--global-batch", "8",
                 "--seq-len", "128", "--top", "3", "--exact", "0", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["status"] == "ok"
    assert doc["rules"] == RULES and doc["gpus"] == 4 and doc["gpu_memory_bytes"] == 2 << 30
    assert doc["counts"]["candidates"] > 10 and doc["counts"]["checked"] == 0
    assert 1 <= len(doc["rows"]) <= 3 and [r["rank"] for r in doc["rows"]] == list(range(1, len(doc["rows"]) + 1))
    for r in doc["rows"]:
        assert r["fits"] and r["estimate"] == "screen" and r["bound"] in BOUNDS and r["tokens_per_s"] > 0
    assert doc["pareto"] and all(set(p) == set(doc["rows"][0]) for p in doc["pareto"])
    assert isinstance(doc["pruned"], dict) and doc["summary"].startswith("small on 4")
