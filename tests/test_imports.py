"""What each entry point imports, measured in fresh interpreters (``sys.modules``), never timed.

Issue 30: starting was slow because everything was imported eagerly (torch alone is seconds on a loaded
2-core machine). These tests fail when a heavy module comes back on a path that must not need it:

* ``import workbench`` loads none of torch, pandas, plotly, ipywidgets, Triton or the SPMD rule modules,
  and sets no ``TRITON_INTERPRET``; its names (``workbench.launch``, ``workbench.plan(...)``, ``Run``,
  ``ModelConfig``, ``workbench.spmd``) still work, imported on first use.
* The command line builds its parser, and prints ``--help`` for every command and subcommand and
  ``--version``, without torch, pandas, numpy or Triton: each handler imports what it uses when it runs.
* The jupyter_server extension registers its routes, in a real ``ServerApp`` with JupyterLab, without
  torch, pandas or numpy: each answer imports its module on the first request.

The static side (no import cycles, one-way packages, no view imports in the core) is tests/test_architecture.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Top-level packages that take from a tenth of a second to seconds to import, and that a light path must not load.
HEAVY = ("torch", "pandas", "numpy", "triton", "plotly", "ipywidgets", "anywidget", "sympy", "scipy")

_LOADED = (f"\nheavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
           "ours = sorted(m for m in sys.modules if m.startswith('workbench'))\n")


def _fresh(code: str, env: dict | None = None, timeout: float = 180) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON document as its last line."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_workbench_loads_nothing_heavy_and_its_names_load_on_first_use():
    code = "import os, sys, json\nimport workbench\n" + _LOADED + """
doc = {"heavy": heavy, "ours": ours, "interpret": os.environ.get("TRITON_INTERPRET")}
# every public name still works (each imports its module now)
doc["version"] = workbench.__version__
doc["config"] = workbench.ModelConfig.__module__ + ":" + ",".join(sorted(workbench.PRESETS)[:2])
doc["interpret_after_config"] = os.environ.get("TRITON_INTERPRET")
doc["launch"] = [workbench.launch.__module__, workbench.Run.__name__, workbench.RunFailed.__name__]
doc["plan_callable"] = callable(workbench.plan) and workbench.plan.ShardingPlan.__name__ == "ShardingPlan"
doc["spmd"] = [callable(workbench.spmd.install), len(workbench.spmd.RULES) > 0]
doc["all"] = sorted(set(workbench.__all__) - set(dir(workbench)))
try:
    workbench.no_such_name
except AttributeError as e:
    doc["missing"] = str(e)
print(json.dumps(doc))
"""
    doc = _fresh(code, env={"TRITON_INTERPRET": None})
    assert doc["heavy"] == [], f"import workbench loaded {doc['heavy']}"
    assert doc["ours"] == ["workbench", "workbench.lazy", "workbench.version"], doc["ours"]
    assert doc["interpret"] is None and doc["interpret_after_config"] is None  # import workbench sets no TRITON_INTERPRET
    from workbench.version import __version__

    assert doc["version"] == __version__
    assert doc["config"].startswith("workbench.config:")
    assert doc["launch"] == ["workbench.train.launcher", "Run", "RunFailed"]
    assert doc["plan_callable"] is True and doc["spmd"] == [True, True] and doc["all"] == []
    assert doc["missing"] == "module 'workbench' has no attribute 'no_such_name'"


def test_plan_is_callable_after_a_lazy_import():
    # `workbench.plan(...)`: the package is the function, whichever way it was first reached
    code = """import json, workbench
from workbench import plan
p = workbench.plan("tiny", dp_shard=2, tp=2)
print(json.dumps({"same": plan is workbench.plan, "world": p.world_size, "type": type(p).__name__}))"""
    assert _fresh(code) == {"same": True, "world": 4, "type": "ShardingPlan"}


def test_importing_the_kernels_sets_triton_interpret_only_without_cuda():
    code = """import json, os, importlib.util
import workbench.config
before = os.environ.get("TRITON_INTERPRET")
import workbench.kernels, torch
print(json.dumps({"before": before, "after": os.environ.get("TRITON_INTERPRET"), "cuda": torch.cuda.is_available(),
                  "triton": importlib.util.find_spec("triton") is not None}))"""
    doc = _fresh(code, env={"TRITON_INTERPRET": None})
    assert doc["before"] is None
    assert doc["after"] == ("1" if doc["triton"] and not doc["cuda"] else None)
    # the user's choice is kept either way
    assert _fresh(code, env={"TRITON_INTERPRET": "0"})["after"] == "0"


_HELP_WALK = """import argparse, contextlib, io, json, sys
from workbench.cli import build_parser, main

def paths(parser, prefix=()):
    yield prefix
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, p in a.choices.items():
                yield from paths(p, prefix + (name,))

out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    main(["--version"])
version = out.getvalue().strip()
seen = {}
for path in paths(build_parser()):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*path, "--help"])
        except SystemExit as e:
            code = e.code
    seen[" ".join(path)] = [code, out.getvalue().startswith("usage: workbench")]
""" + _LOADED + """print(json.dumps({"version": version, "seen": seen, "heavy": heavy, "ours": ours}))"""


def test_cli_help_for_every_command_and_version_import_no_torch():
    doc = _fresh(_HELP_WALK)
    from workbench.version import __version__

    assert doc["version"] == f"workbench {__version__}"
    seen = doc["seen"]
    # the walk reached every command and subcommand (it can fail: a missing one is named here)
    for path in ("", "train", "presets", "plan", "memory predict", "ckpt inspect", "ckpt plan-load", "spmd explain",
                 "kernels check", "rl batch-plan", "doctor"):
        assert seen.get(path) == [0, True], (path, seen.get(path))
    assert len(seen) >= 25 and all(v == [0, True] for v in seen.values()), seen
    assert doc["heavy"] == [], f"the command line's help imported {doc['heavy']}"
    assert not [m for m in doc["ours"] if m.startswith(("workbench.spmd", "workbench.kernels", "workbench.compat"))]


def test_the_heavy_path_is_taken_when_a_command_runs():
    # guards the check above: the same measurement sees torch once a handler needs it
    code = ("import contextlib, io, json, sys\nfrom workbench.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    main(['kernels', 'status', '--json'])\n"
            + _LOADED + "print(json.dumps({'heavy': heavy}))")
    assert "torch" in _fresh(code)["heavy"]


def test_server_extension_registers_its_routes_without_torch(tmp_path):
    (tmp_path / "root").mkdir()
    code = f"""import json, sys
from jupyter_server.serverapp import ServerApp
app = ServerApp()
app.initialize(argv=["--ServerApp.root_dir={tmp_path / 'root'}", "--ServerApp.open_browser=False",
                     "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0", "--ServerApp.port_retries=0",
                     "--IdentityProvider.token=t", "--ServerApp.jpserver_extensions={{\\"workbench.jupyter\\": True}}"])

def patterns(router):
    for rule in getattr(router, "rules", []):
        yield getattr(getattr(rule.matcher, "regex", None), "pattern", "")
        yield from patterns(rule.target)

routes = [p for p in patterns(app.web_app.default_router) if "workbench" in p]
""" + _LOADED + """print(json.dumps({"routes": routes, "heavy": heavy, "ours": ours,
                  "extensions": sorted(app.extension_manager.extensions)}))"""
    env = {"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_PLATFORM_DIRS": "1"}
    doc = _fresh(code, env=env)
    assert "workbench.jupyter" in doc["extensions"] and "jupyterlab" in doc["extensions"]
    from workbench.jupyter.handlers import ROUTES

    for route in ROUTES:  # every route is registered (the check can fail: a route left out is named)
        assert any(f"workbench/api/{route}" in p for p in doc["routes"]), (route, doc["routes"])
    assert any("plotly" in p for p in doc["routes"])
    assert doc["heavy"] == [], f"loading the server extension imported {doc['heavy']}"
    answers = ("checkpoints", "timelines", "plans", "runs", "opening")
    assert not [m for m in doc["ours"] if m.rpartition(".")[2] in answers or m.startswith("workbench.checkpoint")]


def test_constants_the_light_modules_repeat_match_their_owners():
    from workbench import config
    from workbench.checkpoint import cli as ckpt_cli
    from workbench.checkpoint import stats
    from workbench.kernels import backend

    assert ckpt_cli.MAX_BINS == stats.MAX_BINS
    assert backend.BACKENDS is config.KERNEL_BACKENDS


def test_lazy_checkpoint_package_keeps_functions_named_like_their_modules():
    # importing workbench.checkpoint.load binds the module to the package's `load`; the function must win,
    # as when the package imported it eagerly
    code = """import json, types
from workbench.checkpoint.load import LoadResult
from workbench.checkpoint.verify import VerifyReport
import workbench.checkpoint as ckpt
from workbench.checkpoint import diff, plan_load, param_groups
names = {"load": ckpt.load, "verify": ckpt.verify, "diff": diff, "plan_load": plan_load, "param_groups": param_groups,
         "inspect": ckpt.inspect}
print(json.dumps({n: type(f).__name__ for n, f in names.items()}))"""
    assert set(_fresh(code).values()) == {"function"}


@pytest.mark.parametrize("package", ["workbench.plan", "workbench.checkpoint", "workbench.train", "workbench.prediction",
                                     "workbench.memory", "workbench.embedding", "workbench.rl", "workbench.jupyter"])
def test_packages_import_light(package):
    code = f"import json, sys\nimport {package}\n" + _LOADED + "print(json.dumps({'heavy': heavy}))"
    assert _fresh(code)["heavy"] == [], package
