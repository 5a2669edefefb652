"""One schema: every setting is declared once, on its config field, and reaches every face from there."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from workbench import config
from workbench.cli import build_parser, main as cli_main
from workbench.config import ParallelConfig, TrainConfig
from workbench.settings import from_args, make_configs, parse_layout, parse_settings, setting


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        _parse(*argv, "--help")
    return capsys.readouterr().out


@pytest.fixture
def bucket_field(monkeypatch):
    """ParallelConfig with one more setting, declared the one way a setting is declared, and nothing else."""
    # The faces are imported before the patch, so they must read the schema at call time. A module first
    # imported while the patch is on binds the extended class (``from workbench.config import
    # ParallelConfig``); it gets the real one back afterwards, or later tests' isinstance checks fail
    # (workbench.plan raised "must be a ParallelConfig, not ParallelConfig").
    import workbench.plan.cli  # noqa: F401
    import workbench.train.launcher  # noqa: F401
    import workbench.widgets  # noqa: F401

    original, before = config.ParallelConfig, set(sys.modules)
    extended = dataclasses.make_dataclass(
        "ParallelConfig",
        [("bucket_mb", int, setting(25, "gradient bucket size in MiB", min=1))],
        bases=(config.ParallelConfig,), frozen=True)
    monkeypatch.setattr(config, "ParallelConfig", extended)
    yield extended
    for name in set(sys.modules) - before:
        if name.startswith("workbench") and getattr(sys.modules[name], "ParallelConfig", None) is extended:
            setattr(sys.modules[name], "ParallelConfig", original)


def test_a_new_parallel_setting_appears_everywhere_with_one_default(bucket_field, capsys):
    from workbench.plan.cli import _build as plan_configs_from_args
    from workbench.train.launcher import build_job
    from workbench.widgets import RunDashboard

    # workbench train: the flag, its help, its default, and the job it builds
    assert "--bucket-mb" in _help(capsys, "train") and "gradient bucket size in MiB (default: 25)" in _help(capsys, "train")
    assert from_args(_parse("train", "tiny"), "parallel").bucket_mb == 25
    args = _parse("train", "tiny", "--bucket-mb", "50")
    assert from_args(args, "parallel") == bucket_field(bucket_mb=50)
    assert build_job("tiny", nproc=1, bucket_mb=50).parallel.bucket_mb == 50
    # workbench plan
    assert "--bucket-mb" in _help(capsys, "plan")
    parallel, _ = plan_configs_from_args(_parse("plan", "tiny", "--bucket-mb", "50", "--tp", "2"))
    assert (type(parallel), parallel.bucket_mb, parallel.tp) == (bucket_field, 50, 2)
    assert plan_configs_from_args(_parse("plan", "tiny"))[0].bucket_mb == 25
    # workbench ckpt plan-load: the flags, and the --to text layout
    assert "--bucket-mb" in _help(capsys, "ckpt", "plan-load")
    assert from_args(_parse("ckpt", "plan-load", "SRC", "--bucket-mb", "7"), "parallel").bucket_mb == 7
    assert from_args(_parse("ckpt", "plan-load", "SRC"), "parallel").bucket_mb == 25
    # the layout parser
    assert parse_layout("bucket_mb=50,tp=2") == bucket_field(bucket_mb=50, tp=2)
    assert parse_layout("--bucket-mb 50").bucket_mb == 50 and parse_layout("tp=2").bucket_mb == 25
    with pytest.raises(ValueError, match=r"bucket_mb=0 must be a positive integer"):
        parse_layout("bucket_mb=0")
    # the dashboard's controls
    dash = RunDashboard(bucket_mb=50)
    assert dash.controls["bucket_mb"].value == 50 and dash.settings["bucket_mb"] == 50
    assert "gradient bucket size in MiB" in dash.controls["bucket_mb"].tooltip
    assert RunDashboard().settings["bucket_mb"] == 25


def test_choices_are_case_insensitive_and_canonical():
    args = _parse("train", "tiny", "--pp-schedule", "1f1b", "--ac", "FULL", "--mixed-precision", "BF16")
    assert (args.pp_schedule, args.activation_checkpointing, args.mixed_precision) == ("1F1B", "full", "bf16")
    assert _parse("plan", "tiny", "--pp-schedule", "gpipelean").pp_schedule == "GPipeLean"
    assert _parse("ckpt", "plan-load", "SRC", "--pp-schedule", "INTERLEAVED1F1B").pp_schedule == "Interleaved1F1B"
    assert ParallelConfig(pp_schedule="gpipe").pp_schedule == "GPipe"  # the dataclass itself normalizes
    assert TrainConfig(dtype="BFloat16").dtype == "bfloat16"
    assert parse_layout("pp_schedule=1f1b").pp_schedule == "1F1B"


def test_unknown_choice_on_the_command_line_is_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["train", "tiny", "--pp-schedule", "zb"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1
    assert "invalid choice: 'zb' (choose from GPipe, 1F1B, Interleaved1F1B, GPipeLean" in err


def test_dp_shard_has_one_default_everywhere():
    from workbench.plan.cli import _build as plan_configs_from_args

    defaults = {cmd: _parse(*argv).dp_shard for cmd, argv in
                {"train": ("train", "tiny"), "plan": ("plan", "tiny"), "plan-load": ("ckpt", "plan-load", "SRC")}.items()}
    assert defaults == {"train": -1, "plan": -1, "plan-load": -1} and ParallelConfig().dp_shard == -1
    assert parse_layout("tp=2").dp_shard == -1
    # A plan has no nproc: dp_shard=-1 fills nothing more, as `workbench plan` always did with no --dp-shard.
    parallel, train = plan_configs_from_args(_parse("plan", "tiny", "--tp", "2"))
    assert (parallel.dp_shard, parallel.world_size, train.global_batch) == (1, 2, 8)
    parallel, train = plan_configs_from_args(_parse("plan", "tiny", "--dp-shard", "3", "--seq-len", "32"))
    assert (parallel.dp_shard, train.global_batch, train.seq_len) == (3, 9, 32)  # rounded up to a multiple of dp


def test_today_s_flags_keep_working():
    args = _parse("train", "tiny", "--sp", "--tp", "2", "--ac", "selective", "--resume", "--ckpt-every", "5")
    train, parallel = from_args(args, "train"), from_args(args, "parallel")
    assert parallel.sequence_parallel and train.activation_checkpointing == "selective"
    assert (train.resume, train.ckpt_every) == ("latest", 5)  # --resume alone: the newest checkpoint
    assert _parse("train", "tiny", "--resume", "runs/a").resume == "runs/a"
    assert _parse("train", "tiny").resume is None
    long = _parse("train", "tiny", "--sequence-parallel", "--activation-checkpointing", "full")
    assert long.sequence_parallel and long.activation_checkpointing == "full"
    assert _parse("train", "tiny", "--no-spmd-rules").spmd_rules is False
    assert _parse("train", "tiny", "--json").json and _parse("plan", "tiny", "--json").json


def test_bad_layout_text_is_one_line_naming_the_known_keys():
    with pytest.raises(ValueError) as info:
        parse_layout("dp_shard=2,tpp=2")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("layout 'dp_shard=2,tpp=2': unknown setting 'tpp'; known keys are ")
    assert "dp_shard" in msg and "sequence_parallel (sp)" in msg and "pp_schedule" in msg
    with pytest.raises(ValueError, match=r"^layout 'tp=two': tp='two' is not an integer; write e.g. 'dp_shard=2,tp=2'$"):
        parse_layout("tp=two")
    with pytest.raises(ValueError, match=r"pp_schedule='zb' is unknown; choose one of \['GPipe', '1F1B'"):
        parse_layout("pp_schedule=zb")
    with pytest.raises(ValueError, match=r"^layout 'tp': tp needs a value"):
        parse_layout("tp")


def test_bad_layout_on_the_command_line_is_one_error_line(capsys):
    code = cli_main(["ckpt", "plan-load", "nowhere", "--to", "dp_shard=2,tpp=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: layout 'dp_shard=2,tpp=2': unknown")


def test_layout_text_forms():
    assert parse_layout("dp_shard=2,tp=2,sp,pp_schedule=1f1b") == ParallelConfig(dp_shard=2, tp=2,
                                                                              sequence_parallel=True)
    assert parse_layout("--dp-shard 2 --tp 2 --sp --zero 2") == ParallelConfig(dp_shard=2, tp=2, sequence_parallel=True,
                                                                              zero=2)
    assert parse_layout("tp=2 sp=false microbatches=none").sequence_parallel is False
    assert parse_layout("tp=2,no_sp") == ParallelConfig(tp=2)
    # A live-check layout mixes both configs; each key goes to its own.
    values = parse_settings("dp_shard=2,mixed_precision=BF16,steps=3", ("parallel", "train"))
    assert values == {"dp_shard": 2, "mixed_precision": "bf16", "steps": 3}
    parallel, train = make_configs(**values)
    assert (parallel.dp_shard, train.mixed_precision, train.steps) == (2, "bf16", 3)


def test_configs_and_shortcuts_meet_in_one_place():
    from workbench.train.launcher import build_job

    job = build_job("tiny", nproc=4, parallel=ParallelConfig(tp=2), train=TrainConfig(steps=3), seed=5)
    assert (job.parallel.dp_shard, job.parallel.tp, job.train.steps, job.train.seed) == (2, 2, 3, 5)
    assert build_job("tiny", nproc=2, parallel={"dp_shard": 2}).parallel.dp_shard == 2
    with pytest.raises(ValueError, match=r"^unknown training setting\(s\) \['tpp'\]; known: "):
        build_job("tiny", tpp=2)


def test_plan_takes_configs_and_shortcuts():
    from workbench.plan import plan_configs

    assert plan_configs(tp=2, seq_len=32) == (ParallelConfig(dp_shard=1, tp=2), TrainConfig(seq_len=32))
    parallel, train = plan_configs(ParallelConfig(dp_shard=4), TrainConfig(global_batch=16), pp_schedule="gpipe")
    assert (parallel.pp_schedule, train.global_batch) == ("GPipe", 16)


def test_range_messages_come_from_the_field_metadata():
    for kwargs, message in [
        (dict(ema=1.0), "ema=1.0 must be a decay in [0, 1), e.g. 0.999 (0 turns it off)"),
        (dict(ckpt_every=-1), "ckpt_every=-1 must be an integer >= 0 (0 turns it off)"),
        (dict(grad_clip=-1.0), "grad_clip=-1.0 must be >= 0 (0 turns clipping off)"),
        (dict(steps=True), "steps=True must be a positive integer"),
        (dict(data="Imagenet"), "data='Imagenet' is unknown; choose one of ['synthetic', 'text']"),
    ]:
        with pytest.raises(ValueError) as info:
            TrainConfig(**kwargs)
        assert str(info.value) == message
    with pytest.raises(ValueError, match=r"^zero=True is unknown; choose a ZeRO stage in \[0, 1, 2, 3\]$"):
        ParallelConfig(zero=True)
    assert ParallelConfig(dp_shard=-1).dp_shard == -1  # -1 is allowed outside the range: "the rest of nproc"


def test_controls_follow_the_field_kinds():
    from ipywidgets import BoundedIntText, Checkbox, Dropdown

    from workbench.widgets.controls import read_controls, setting_controls, write_controls

    controls = setting_controls("parallel", {"tp": 2, "pp_schedule": "gpipe"})
    assert list(controls) == [f.name for f in dataclasses.fields(ParallelConfig)]
    assert isinstance(controls["sequence_parallel"], Checkbox) and isinstance(controls["zero"], Dropdown)
    assert list(controls["pp_schedule"].options) == list(config.PP_SCHEDULES)
    assert isinstance(controls["dp_shard"], BoundedIntText) and controls["dp_shard"].min == -1
    assert "-1: the rest of nproc" in controls["dp_shard"].tooltip
    assert read_controls(controls, "parallel") == ParallelConfig(tp=2, pp_schedule="GPipe").to_dict()
    write_controls(controls, "parallel", microbatches=4)
    assert read_controls(controls, "parallel")["microbatches"] == 4
    write_controls(controls, "parallel", microbatches=None)
    assert controls["microbatches"].value == 0 and read_controls(controls, "parallel")["microbatches"] is None
    with pytest.raises(TypeError, match="unknown setting 'tpp'"):
        write_controls(controls, "parallel", tpp=2)
