"""`make gpu-check` on a machine without a GPU: its plumbing, so the command cannot rot between GPU loans.

The GPU parts skip with the reason, the others run for real (the bundle step, the environment probe,
doctor, `import workbench`, a 2-rank gloo run), and the summary has its documented shape. The bundle's pin
list is held to pyproject.toml offline (nothing is downloaded here), and the install step is run on a
wheel made here: pip with no index, into the check's own folder, and a torch wheel refused.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import json
import subprocess
import sys
import tarfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _module(name: str):
    """gpu/<name>.py (a folder of scripts, not a package), as module ``gpu_<name>``."""
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", REPO / "gpu" / f"{name}.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)  # it puts gpu/ on sys.path for its sibling bundle.py
    finally:
        while str(REPO / "gpu") in sys.path:
            sys.path.remove(str(REPO / "gpu"))
    return mod


check = _module("check")
bundle = check.bundle


@pytest.mark.multirank  # its cpu_2rank part starts two gloo ranks through torchrun
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the plumbing on a machine without a GPU")
def test_make_gpu_check_without_a_gpu_skips_the_gpu_parts_and_runs_the_rest(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run(["make", "gpu-check", f"GPU_PYTHON={sys.executable}", f"GPU_CHECK_OUT={out}",
                        f"GPU_CHECK_WORK={work}", f"GPU_BUNDLE={tmp_path / 'no-bundle'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=220)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["schema"] == "workbench.gpu_check/1" and s["status"] == "ok" and s["quick"] is False
    assert s["gpu"] is None and s["complete"] is False and "no GPU figures" in s["note"]
    assert s["machine"]["torch"] == torch.__version__ and s["machine"]["cuda_available"] is False
    assert s["deadline_s"] == 480 and 0 < s["wall_s"] < 480
    parts = s["parts"]
    assert list(parts) == list(check.PARTS)
    for name, part in parts.items():
        assert part["status"] in ("ok", "skipped"), (name, part)
        assert part["budget_s"] > 0 and part["seconds"] >= 0, name
        assert part["commands"] or name == "install", name  # install had nothing to install: no pip
        if part["status"] == "skipped":
            assert part["reason"].startswith("no CUDA GPU: torch ") and "CPU build" in part["reason"], name
    assert s["skipped_gpu_parts"] == list(check.GPU_PARTS)
    assert {n for n, p in parts.items() if p["status"] == "ok"} == {"install", "environment", "doctor", "import",
                                                                    "cpu_2rank"}
    assert s["counts"] == {"ok": 5, "failed": 0, "timed_out": 0, "skipped": 6}
    # what a skipped part would run is still written down, with the GPU machine's settings
    assert any("--device cuda" in c and "memory predict" in c for c in parts["memory"]["commands"])
    assert "benchmarks/bench_kernels.py --targets" in parts["bench_kernels"]["commands"][0]
    assert "-m gpu tests/test_gpu.py" in parts["pytest"]["commands"][0]

    install = parts["install"]["figures"]  # this venv has every pinned package: nothing to install
    assert parts["install"]["reason"].startswith("nothing to install") and install["installed"] == []
    assert len(install["present"]) == install["pins"] == len(bundle.Spec().pins)
    env = parts["environment"]["figures"]
    assert env["unmet"] == [] and env["requirements_checked"] >= len(bundle.Spec().pins) + 9
    doctor = parts["doctor"]["figures"]
    assert doctor["cuda_available"] is False and doctor["backends"]["gloo"] is True
    imp = parts["import"]["figures"]
    assert Path(imp["workbench"]) == REPO / "workbench" and imp["import_s"] > 0 and imp["launch_import_s"] > 0
    assert imp["view_modules_loaded"] == []  # the GPU path needs no view package, JupyterLab least of all
    two = parts["cpu_2rank"]["figures"]
    assert two["ranks"] == [0, 1] and two["backends"] == ["gloo"] and two["devices"] == ["cpu"]
    assert two["status"] == "succeeded" and two["layout"] == "tp=2"

    assert s["files"] == {"logs": "logs.tar.gz", "progress": "check.log"}
    assert "cpu_2rank: ok" in (out / "check.log").read_text()
    with tarfile.open(out / "logs.tar.gz") as tar:
        doc = json.load(tar.extractfile("logs/doctor.out"))
        assert doc["status"] == "ok" and "logs/cpu_2rank.err" in tar.getnames()


def test_budgets_fit_the_deadlines_and_the_pytest_selections_name_real_tests():
    for mode, budgets in check.BUDGETS.items():
        serial = sum(budgets[check._key(p)] for p in check.SERIAL if mode == "full" or p not in check.QUICK_SKIPS)
        assert serial <= check.DEADLINE[mode] - check.MARGIN_S, (mode, serial)
        assert max(budgets["cpu_2rank"], budgets["predictions"]) < check.DEADLINE[mode]
    assert check.DEADLINE == {"full": 480.0, "quick": 180.0}  # the 8 and 3 minutes
    tree = ast.parse((REPO / "tests" / "test_gpu.py").read_text())
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    assert len([n for n in names if "one_rank_trains" in n]) == 1  # --quick's -k
    assert len([n for n in names if "gpu_benchmarks_smoke" in n]) == 1  # deselected: the check runs both in full


def test_the_memory_grid_is_valid_and_shares_bench_gpu_train_s_model():
    from workbench.cli import build_parser
    from workbench.config import ModelConfig
    from workbench.prediction.memory import _job
    from workbench.settings import from_args

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_gpu_train
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    model = ModelConfig.from_hf_config(REPO / check.LLAMA)
    assert bench_gpu_train.default_model() == model and 850e6 < model.n_params < 1.1e9  # ~1B, one definition
    parser = build_parser()
    for name, (m, seq_len, flags) in check.MEMORY_GRID.items():
        model = str(REPO / m) if m.endswith(".json") else m
        args = check.Check._memory_args(seq_len, flags)
        pred = parser.parse_args(["memory", "predict", model, *args, "--device", "cuda", "--json"])
        job = _job(model, parallel=from_args(pred, "parallel"), train=from_args(pred, "train"), nproc=pred.nproc)
        assert job.train.global_batch == 8 and job.train.seq_len == seq_len, name
        train = parser.parse_args(["train", model, *args, "--device", "cuda", "--steps", "2", "--json"])
        assert train.device == "cuda" and train.nproc == 1, name
    assert set(check.MEMORY_QUICK) <= set(check.MEMORY_GRID)


def test_the_bundle_covers_pyproject_pins_one_version_each_and_never_torch():
    spec = bundle.Spec()
    assert spec.problems == []
    assert bundle.coverage_problems(spec) == []
    assert {"ipywidgets", "plotly", "anywidget"} <= set(spec.pins) and "jupyterlab" in spec.omit
    assert {"torch", "triton"} <= spec.image and not any(bundle.FORBIDDEN.match(n) for n in spec.pins)
    assert spec.python == "3.12" and all(p.startswith("manylinux") and p.endswith("_x86_64")
                                         for p in spec.target["platforms"])

    def installed(name, version):  # the pins' own requirements, from this venv where it has that version
        try:
            return metadata.requires(name) or [] if metadata.version(name) == version else None
        except metadata.PackageNotFoundError:
            return None

    problems, unknown = bundle.closure_problems(spec, installed)
    assert problems == []
    print("pins whose requirements this venv could not show (another version installed):", unknown)


def test_the_bundle_checks_catch_what_they_are_for(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[image]\npackages = ["traitlets"]\n[pins]\ntorch = "2.11.0"\nprompt_toolkit = "3.0.53"\n'
                   'prompt-toolkit = "3.0.52"\ntraitlets = ">=5"\n')
    problems = " | ".join(bundle.Spec(bad).problems)
    for needle in ("torch must not be bundled", "pinned twice", "not one exact version", "both pinned and in [image]"):
        assert needle in problems, needle
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch>=2.11", "plotly>=99", "leftpad>=1"]\n')
    problems = " | ".join(bundle.coverage_problems(bundle.Spec(), pyproject))
    assert "plotly==" in problems and "outside pyproject's range" in problems and "leftpad>=1" in problems
    problems, unknown = bundle.closure_problems(bundle.Spec(), lambda n, v: ["leftpad>=1"] if n == "plotly" else
                                                ["traitlets>=99"] if n == "comm" else None)
    assert any("plotly" in p and "leftpad" in p for p in problems)
    assert any("comm" in p and "traitlets is pinned at" in p for p in problems)
    assert len(unknown) == len(bundle.Spec().pins) - 2


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of one module, made here."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{name.replace('-', '_')}.py": b"VALUE = 42\n",
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
                     f"{len(b)}\n" for n, b in files.items()) + f"{dist}.dist-info/RECORD,,\n"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


@pytest.mark.timeout(120)
def test_install_puts_missing_pins_into_its_own_folder_offline_and_refuses_a_torch_wheel(tmp_path):
    wheels, work = tmp_path / "bundle", tmp_path / "work"
    wheels.mkdir()
    _wheel(wheels, "gpucheck-probe", "1.0")
    spec = tmp_path / "bundle.toml"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    spec.write_text(f'[target]\npython = "{py}"\n[image]\npackages = []\n[pins]\ngpucheck-probe = "1.0"\n')

    def run():
        p = subprocess.run([sys.executable, str(REPO / "gpu" / "check.py"), "--parts", "install", "--spec", str(spec),
                            "--bundle", str(wheels), "--out", str(tmp_path / "out"), "--work", str(work)],
                           capture_output=True, text=True, timeout=100, cwd=REPO)
        return p, json.loads((tmp_path / "out" / "summary.json").read_text())["parts"]

    p, parts = run()
    assert p.returncode == 0, p.stderr[-3000:]
    install = parts["install"]
    assert install["status"] == "ok" and install["figures"]["installed"] == ["gpucheck-probe==1.0"]
    assert "--no-index --no-deps" in install["commands"][0] and "--target" in install["commands"][0]
    assert (work / "site" / "gpucheck_probe.py").read_text() == "VALUE = 42\n"
    assert parts["environment"]["status"] == "ok"  # install and environment always run
    assert all(parts[n]["reason"] == "not in --parts" for n in check.PARTS if n not in ("install", "environment"))

    (wheels / "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    p, parts = run()
    assert p.returncode == 1
    install = parts["install"]
    assert install["status"] == "failed" and "refused torch-2.11.0" in install["reason"]
    assert install["commands"] == [] and not (work / "site").exists()  # pip never ran


@pytest.mark.timeout(120)
def test_a_part_past_its_budget_is_killed_with_all_its_processes_and_marked_timed_out(tmp_path):
    work = tmp_path / "work"
    p = subprocess.run([sys.executable, str(REPO / "gpu" / "check.py"), "--parts", "cpu_2rank", "--budget",
                        "cpu_2rank=2", "--out", str(tmp_path / "out"), "--work", str(work), "--bundle",
                        str(tmp_path / "no-bundle")], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert p.returncode == 1, p.stderr[-3000:]  # a part that timed out fails the check
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    part = s["parts"]["cpu_2rank"]
    assert s["status"] == "failed" and s["counts"]["timed_out"] == 1
    assert part["status"] == "timed_out" and part["seconds"] < 10 and part["reason"].startswith("killed at the end")
    assert part["commands"] and "--timeout 2" in part["commands"][0]
    # the command's whole process group went: the CLI, torchrun's agent and its ranks (all name the run's folder)
    left = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(work).encode() in (proc / "cmdline").read_bytes():
                left.append(proc.name)
        except OSError:
            pass
    assert left == []


def test_a_killed_part_takes_the_processes_it_started_in_sessions_of_their_own(tmp_path):
    """As the launcher starts torchrun's agent: a grandchild in a new session, which a signal to the part's
    process group does not reach."""
    marker = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
            f"open({str(marker)!r}, 'w').write(str(c.pid)); time.sleep(120)")
    job = check.Job("sleeper", [sys.executable, "-c", code], tmp_path, {}).start()
    deadline = time.monotonic() + 30
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(marker.read_text())
    job.wait(0.1)  # past its time: killed
    assert job.timed_out and job.done
    assert not check._alive(grandchild)


def test_memory_runs_share_the_gpu_as_far_as_their_predictions_fit(tmp_path):
    """run_packed: an unknown one first and alone, then the largest first with the next that fits beside it
    within the capacity; whatever still runs at the deadline is killed (except what another part waits for)."""
    def sleeper(name, seconds):
        return check.Job(name, [sys.executable, "-c", f"import time; time.sleep({seconds})"], tmp_path, {})

    big, mid, small, unknown = sleeper("big", 1.0), sleeper("mid", 1.0), sleeper("small", 1.0), sleeper("unknown", 0.5)
    check.run_packed([(small, 4), (unknown, None), (big, 6), (mid, 5)], capacity=10, until=time.monotonic() + 30,
                     poll_s=0.05)
    assert all(j.done and j.rc == 0 and not j.timed_out for j in (big, mid, small, unknown))

    def overlap(a, b):
        return a.t0 < b.t1 and b.t0 < a.t1

    assert overlap(big, small) and not overlap(big, mid)  # 6 + 4 fit in 10, 6 + 5 do not
    assert not any(overlap(unknown, j) for j in (big, mid, small))
    assert unknown.t1 <= big.t0 < mid.t0  # the unknown one first, alone; then the largest

    slow, kept, never = sleeper("slow", 60), sleeper("kept", 60), sleeper("never", 1)
    check.run_packed([(slow, 6), (kept, 1), (never, 6)], capacity=10, until=time.monotonic() + 1.0, poll_s=0.05,
                     leave=(kept,))
    assert slow.timed_out and slow.done and never.proc is None
    assert not kept.done  # left running for the part that waits for it
    kept.kill()
