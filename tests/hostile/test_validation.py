"""Every command validates before it works: a bad value is one ``error:`` line and exit 2, or exactly one
``{"status": "error"}`` document under ``--json``; never a traceback, and a size over its limit is refused
before any work.

The bad values are enumerated from the schema itself (each setting's range edges: below ``min``, above
``max`` and ``limit``, NaN and infinities, the wrong type, an unknown choice), plus the cross-field rules
and the flags outside the configs. They run in-process through ``workbench.cli.main`` (fast), a few
through the real console script, and hostile config.json files through train, plan and memory predict.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.config import MAX_LAYERS, MAX_RANKS, ModelConfig, ParallelConfig, TrainConfig
from workbench.schema import kind_of, settings_of

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------------------------------
# The bad values: from the schema, then the rules and flags it does not hold
# --------------------------------------------------------------------------------------------------


def _edges(cls: type, only: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """(flag, text) pairs just outside each setting's range, for the settings on the command line."""
    out = []
    for f, s in settings_of(cls, only):
        if not s.cli:
            continue
        flag = s.flags(f.name)[0]
        kind, _ = kind_of(f)
        if kind in ("bool", "str") and not s.choices:
            continue
        if s.choices:
            out.append((flag, "bogus"))
            continue
        if kind == "int":
            out.append((flag, "1.5"))  # not an integer
            if s.min is not None:
                out.append((flag, str(int(s.min) - 1)))
        else:
            out += [(flag, "nan"), (flag, "inf"), (flag, "-inf")]
            if s.min is not None:
                out.append((flag, repr(float(s.min)) if s.exclusive_min else repr(s.min - 1.0)))
        if s.max is not None:
            out.append((flag, repr(float(s.max)) if s.exclusive_max else str(int(s.max) + 1)))
        if s.limit is not None:
            out.append((flag, str(int(s.limit) + 1)))
    return out


TRAIN_RULES = [  # cross-field rules and the flags outside the configs
    ["--sp"], ["--zero-stall"], ["--ckpt-async"], ["--compile", "--memory"],
    ["--mixed-precision", "bf16", "--dtype", "bfloat16"], ["--microbatches", "2"], ["--tp", "3"],
    ["--seq-len", "100000"], ["--ep", "2"], ["--pp", "9"], ["--global-batch", "3", "--dp-shard", "2"],
    ["--dp-shard", "65536", "--tp", "8"], ["--tp", "512", "--pp", "512"],
    ["--seed", str(2 ** 70)], ["--nproc", "0"], ["--nproc", str(10 ** 6)], ["--nnodes", "0"],
    ["--node-rank", "-1"], ["--timeout", "nan"], ["--timeout", "0"], ["--timeout", "-1"], ["--timeout", "inf"],
    ["--rdzv-timeout", "-1"], ["--rdzv-timeout", "nan"], ["--node-rank", "1"], ["--ema", "2"], ["--lr", "nan"],
]


def _train_cases() -> list[list[str]]:
    cases = [[flag, text] for flag, text in _edges(ParallelConfig) + _edges(TrainConfig) + _edges(ModelConfig)]
    return cases + TRAIN_RULES


# --------------------------------------------------------------------------------------------------
# Running the CLI in-process
# --------------------------------------------------------------------------------------------------


def _run(argv: list[str]) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, CPU seconds) of ``workbench ARGV`` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    cpu = time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue(), time.process_time() - cpu


def _refused(argv: list[str]) -> str:
    """Assert ``argv`` is refused as bad input, in text and under --json; the one error message."""
    code, out, err, _ = _run(argv)
    assert code == 2, (argv, code, out, err)
    assert "Traceback" not in err + out and out == "", (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    code, out, err, _ = _run([*argv, "--json"])
    assert code == 2 and "Traceback" not in err, (argv, code, err)
    doc = json.loads(out)  # exactly one document: json.loads refuses trailing text
    assert doc["status"] == "error" and isinstance(doc["error"], str) and "\n" not in doc["error"], (argv, doc)
    return doc["error"]


@pytest.fixture(autouse=True)
def _no_launch(monkeypatch, tmp_path):
    """A case that passed validation by mistake must fail here, not start training ranks."""
    import workbench.embedding.trainer as embedding_trainer
    import workbench.train.launcher as launcher

    def launched(*args, **kwargs):
        raise AssertionError("validation let a bad value through: the job was launched")

    monkeypatch.setattr(launcher, "launch", launched)
    monkeypatch.setattr(embedding_trainer, "train_embedding", launched)
    monkeypatch.chdir(tmp_path)


def test_every_bad_train_value_is_one_line(tmp_path):
    """Row 9: 31 such values printed a 20-line traceback with exit 1 (and no JSON under --json)."""
    cases = _train_cases()
    assert len(cases) >= 60
    outcomes = {}
    for case in cases:
        outcomes[" ".join(case)] = _refused(["train", "tiny", *case])
    # A few words of the messages: the field, the value and what is allowed or what to change.
    assert outcomes["--steps 0"] == "steps=0 must be a positive integer"
    assert outcomes["--lr nan"] == "lr=nan must be a positive finite number"
    assert outcomes["--tp 0"] == "tp=0 must be a positive integer"
    assert outcomes["--sp"].startswith("sequence_parallel needs tp > 1")
    assert outcomes["--keep 0"] == "keep=0 must be a positive integer"
    assert outcomes["--zero-stall"].startswith("ckpt_async/zero_stall need periodic checkpoints")
    assert outcomes["--ema 2"] == "ema=2.0 must be a decay in [0, 1), e.g. 0.999 (0 turns it off)"
    assert outcomes["--seed -1"] == "seed=-1 must be an integer in [0, 4294967295]"
    assert outcomes[f"--seed {2 ** 70}"].startswith(f"seed={2 ** 70} must be an integer in [0, ")
    assert outcomes["--timeout nan"].endswith("timeout=nan must be a positive finite number of seconds")
    assert outcomes["--rdzv-timeout -1"].endswith("rdzv_timeout=-1.0 must be a positive finite number of seconds")
    assert outcomes[f"--dp-shard {MAX_RANKS + 1}"] == (
        f"dp_shard={MAX_RANKS + 1} is over the limit of {MAX_RANKS:,} (workbench plans and runs up to "
        f"{MAX_RANKS:,} ranks); choose dp_shard <= {MAX_RANKS}")
    assert "is over the limit of 65,536" in outcomes["--dp-shard 65536 --tp 8"]


def test_output_directory_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("not a directory")
    assert _refused(["train", "tiny", "--out", "f"]).endswith("f: is a file, not a directory; pass a directory path "
                                                              "(new or existing)")
    assert "lies under f, which is a file" in _refused(["train", "tiny", "--out", "f/run"])
    # memory predict checks its --out at once, not after the prediction's work (it failed after 10 s)
    code, out, err, cpu = _run(["memory", "predict", "llama-70b", "--tp", "8", "--out", "f"])
    assert code == 2 and "f: is a file" in err and cpu < 1.0
    assert "f: is a file" in _refused(["memory", "import", "x.pickle", "--out", "f"])
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # nothing was created beside it


def test_plan_predict_and_tools_refuse_bad_flags(tmp_path):
    cases = [["plan", "tiny", flag, text] for flag, text in _edges(ParallelConfig)]
    cases += [["plan", "tiny", flag, text] for flag, text in
              _edges(TrainConfig, ("global_batch", "micro_batch", "seq_len", "dtype", "mixed_precision"))]
    cases += [["memory", "predict", "tiny", flag, text] for flag, text in _edges(ParallelConfig) + _edges(TrainConfig)]
    cases += [
        ["plan", "tiny", "--memory", "cpu", "--budget", "lots"],
        ["memory", "predict", "tiny", "--budget", "lots"], ["memory", "predict", "tiny", "--nproc", "0"],
        ["memory", "show", "x", "--top", "-5"], ["memory", "show", "x", "--rank", "-1"],
        ["memory", "record", "tiny", "--steps", "0"], ["memory", "record", "tiny", "--timeout", "nan"],
        ["ckpt", "stats", "x", "k", "--bins", "-3"], ["ckpt", "stats", "x", "k", "--bins", "1e8"],
        ["ckpt", "stats", "x", "k", "--bins", "100000000"], ["ckpt", "diff", "a", "b", "--top", "-5"],
        ["ckpt", "inspect", "x", "--limit", "-1"], ["ckpt", "plan-load", "x", "--tp", "0"],
        ["spmd", "check", "--timeout", "nan"], ["spmd", "check", "--cap", "-1"],
        ["kernels", "bench", "--repeats", "0"], ["kernels", "bench", "--sizes", "0,-5"],
        ["kernels", "check", "--size", "0"],
        ["rl", "batch-plan", "--prompts", "0", "-n", "4", "--mini-batch", "8 samples", "--micro-batch",
         "4 samples/rank", "--world-size", "1"],
        ["rl", "batch-plan", "--prompts", "8", "-n", "4", "--mini-batch", "8 samples", "--micro-batch",
         "4 samples/rank", "--world-size", str(10 ** 12)],
        ["train-embedding", "--steps", "0"], ["train-embedding", "--temperature", "nan"],
        ["train-embedding", "--timeout", "-1"], ["train-embedding", "--nproc", "0"],
    ]
    for argv in cases:
        _refused(argv)
    assert len(cases) >= 80


@pytest.mark.parametrize("argv, words", [
    (["plan", "llama-70b", "--dp-shard", "1000000"], "dp_shard=1000000 is over the limit of 65,536"),
    (["plan", "llama-70b", "--dp-shard", "8192", "--tp", "8", "--pp", "4"], "262,144 ranks is over the limit"),
    (["train", "llama-70b", "--nproc", "1000000"], "nproc=1000000 is over the limit of 65,536"),
    (["memory", "predict", "llama-70b", "--nproc", "1000000"], "nproc=1000000 is over the limit of 65,536"),
    (["memory", "predict", "llama-70b", "--dp-shard", "1000000"], "dp_shard=1000000 is over the limit"),
    (["ckpt", "stats", "missing", "key", "--bins", "100000000"], "bins=100000000 is over the limit of 10,000"),
    (["train", "tiny", "--global-batch", str(1 << 40)], "global_batch=1099511627776 is over the limit"),
    (["train", "tiny", "--steps", str(10 ** 12)], "steps=1000000000000 is over the limit"),
])
def test_sizes_over_their_limit_are_refused_before_any_work(argv, words):
    """Row 12: these ran for minutes (or until memory ran out) before; now a few milliseconds of CPU."""
    _run(["presets"])  # imports paid once, outside the measurement
    code, out, err, cpu = _run(argv)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert cpu < 1.0, (argv, cpu)


# --------------------------------------------------------------------------------------------------
# Hostile config.json files
# --------------------------------------------------------------------------------------------------

_LLAMA = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
          "intermediate_size": 256, "vocab_size": 256}


def _hostile_configs(d: Path) -> dict[str, str]:
    """{file name: words its refusal must contain}, the files written into ``d``."""
    texts = {
        "list.json": ("[1, 2]", "holds a JSON list, not an object"),
        "text.json": ('"llama"', "holds a JSON str"),
        "deep.json": ("[" * 100_000 + "]" * 100_000, "nests deeper than JSON is read here"),
        "deep_value.json": ('{"hidden_size": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests deeper"),
        "hidden_1e30.json": (json.dumps({**_LLAMA, "hidden_size": 1e30}), "hidden_size=1e+30 must be a positive "
                                                                          "integer"),
        "hidden_text.json": (json.dumps({**_LLAMA, "hidden_size": "128"}), "hidden_size='128' must be a positive"),
        "hidden_bool.json": (json.dumps({**_LLAMA, "hidden_size": True}), "hidden_size=True must be"),
        "hidden_huge.json": (json.dumps({**_LLAMA, "hidden_size": 10 ** 40}), "hidden_size=<an integer of 133 "
                                                                              "bits> is over the limit"),
        "eps_text.json": (json.dumps({**_LLAMA, "rms_norm_eps": "small"}), "rms_norm_eps='small' must be a number"),
        "theta_nan.json": (json.dumps({**_LLAMA, "rope_theta": math.nan}), "rope_theta=nan must be a positive"),
        "tie_text.json": (json.dumps({**_LLAMA, "tie_word_embeddings": "false"}), "tie_word_embeddings='false' "
                                                                                  "must be True or False"),
        "layers.json": (json.dumps({**_LLAMA, "num_hidden_layers": 100_000}),
                        f"num_hidden_layers=100000 is over the limit of {MAX_LAYERS:,}"),
        "vocab_neg.json": (json.dumps({**_LLAMA, "vocab_size": -1}), "vocab_size=-1 must be a positive integer"),
        "long_int.json": (json.dumps(_LLAMA)[:-1] + ', "vocab_size": ' + "9" * 5000 + "}", "a number too long"),
        "model_type.json": (json.dumps({**_LLAMA, "model_type": ["x"] * 1000}), "model_type=<a list of 1000 "
                                                                               "item(s)> is not a Llama"),
    }
    for name, (text, _) in texts.items():
        (d / name).write_text(text)
    (d / "latin1.json").write_bytes(b'{"model_type": "\xff"}')
    os.mkfifo(d / "fifo.json")
    with open(d / "sparse.json", "wb") as f:  # 17 MiB that it claims, in no disk space: refused by its size
        f.truncate(17 << 20)
    return {**{name: words for name, (_, words) in texts.items()}, "latin1.json": "is not UTF-8 text",
            "fifo.json": "is a FIFO (named pipe), not a regular file", "sparse.json": "more than a config.json can be"}


def test_hostile_config_json_in_train_plan_and_predict(tmp_path):
    expected = _hostile_configs(tmp_path)
    for name, words in expected.items():
        for command in (["train"], ["plan"], ["memory", "predict"]):
            code, out, err, cpu = _run([*command, name])
            assert code == 2 and err.startswith(f"error: {name}: ") and words in err, (command, name, err)
            assert len(err.strip().splitlines()) == 1 and cpu < 2.0, (command, name, err, cpu)
    assert len(expected) * 3 >= 50


def test_hostile_config_dicts_through_the_api():
    """The API face: the same checks for a dict, and for ModelConfig and the config classes themselves."""
    with pytest.raises(ValueError, match=r"^config: hidden_size=1e\+30 must be a positive integer$"):
        ModelConfig.from_hf_config({**_LLAMA, "hidden_size": 1e30})
    with pytest.raises(ValueError, match=r"^n_layers=100000 is over the limit of 1,024"):
        ModelConfig(n_layers=100_000)
    with pytest.raises(ValueError, match=r"^norm_eps='1e-5' must be a number in \(0, 1\]"):
        ModelConfig(norm_eps="1e-5")
    with pytest.raises(ValueError, match=r"needs an object of fields, not list"):
        ModelConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match=r"^lr=nan must be a positive finite number$"):
        TrainConfig(lr=math.nan)
    with pytest.raises(ValueError, match=r"^nproc=1000000 is over the limit of 65,536"):
        ParallelConfig().resolved(10 ** 6)
    from workbench.train.launcher import build_job

    with pytest.raises(ValueError, match=r"^seed=-1 must be an integer in \[0, 4294967295\]$"):
        build_job("tiny", seed=-1)


def test_widget_controls_refuse_what_the_schema_refuses():
    pytest.importorskip("ipywidgets")
    from workbench.widgets.controls import setting_controls, write_controls

    controls = setting_controls("parallel")
    with pytest.raises(ValueError, match=r"^tp=1000000 is over the limit of 65,536"):
        write_controls(controls, "parallel", tp=10 ** 6)


# --------------------------------------------------------------------------------------------------
# The generic wrappers: words, not exception names; the traceback only on request
# --------------------------------------------------------------------------------------------------


def test_unforeseen_errors_name_the_file_and_the_problem(monkeypatch, capsys):
    import errno

    from workbench.checkpoint.cli import _guard
    from workbench.cli_output import describe_exception

    assert describe_exception(OSError(errno.ENOSPC, "No space left on device", "/data/ckpt/x")) == \
        "/data/ckpt/x: no space left on device; the disk is full; free space or pass a path on another disk"
    assert describe_exception(PermissionError(errno.EACCES, "Permission denied", "runs/r1")) == \
        "runs/r1: permission denied; check its permissions"
    assert describe_exception(RecursionError("maximum recursion depth exceeded"), "runs/r1") == \
        "runs/r1: nested too deeply to read; the input is damaged or hostile"
    assert describe_exception(MemoryError(), "a.pt").startswith("a.pt: needs more memory than this machine has")
    assert describe_exception(EOFError("Ran out of input"), "a.pt") == \
        "a.pt: ends before its data does; the file is truncated or damaged"
    bad_text = UnicodeDecodeError("utf-8", b"ab\xff", 2, 3, "invalid start byte")
    assert describe_exception(bad_text, "w.json") == "w.json: not UTF-8 text (byte 2); the input is damaged or not text"

    class Args:
        json, path, src, a, b = False, "runs/r1", None, None, None

    def recursion(args):
        raise RecursionError("maximum recursion depth exceeded while calling a Python object")

    def bug(args):
        raise IndexError("list index out of range")

    assert _guard(recursion)(Args()) == 1
    assert capsys.readouterr().err == "error: runs/r1: nested too deeply to read; the input is damaged or hostile\n"
    assert _guard(bug)(Args()) == 1
    assert capsys.readouterr().err == ("error: runs/r1: IndexError: list index out of range; set WORKBENCH_DEBUG=1 "
                                       "for the traceback\n")
    monkeypatch.setenv("WORKBENCH_DEBUG", "1")
    with pytest.raises(IndexError):
        _guard(bug)(Args())


def test_the_top_level_net_catches_what_a_command_did_not(monkeypatch):
    import workbench.cli as cli

    def broken(args):
        raise OSError(28, "No space left on device", "runs/x/events.jsonl")

    monkeypatch.setattr(cli, "cmd_presets", broken)
    code, out, err, _ = _run(["presets"])
    assert code == 1 and err == ("error: runs/x/events.jsonl: no space left on device; the disk is full; free space "
                                 "or pass a path on another disk\n")
    code, out, err, _ = _run(["presets", "--json"])
    assert code == 1 and json.loads(out)["status"] == "error" and err == ""


# --------------------------------------------------------------------------------------------------
# The real console script
# --------------------------------------------------------------------------------------------------


def test_console_script(workbench_cli, tmp_path):
    """The installed command, end to end: a bad value and a hostile config.json, as text and as JSON (run at
    once: most of each is the interpreter starting)."""
    (tmp_path / "list.json").write_text("[]")
    runs = [subprocess.Popen([*workbench_cli, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=tmp_path)
            for argv in (["train", "tiny", "--steps", "0"], ["train", "list.json", "--lr", "nan", "--json"])]
    (out, err), (jout, jerr) = (p.communicate(timeout=120) for p in runs)
    assert runs[0].returncode == 2 and out == "" and err == "error: steps=0 must be a positive integer\n"
    assert runs[1].returncode == 2 and "Traceback" not in jerr and json.loads(jout) == {
        "status": "error", "error": "lr=nan must be a positive finite number"}
