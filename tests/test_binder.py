"""Binder builds what repo2docker renders from binder/: CPU-only torch, no pip cache, and our package,
and opens JupyterLab in notebooks/ (the server config postBuild installs, read by a real server).

`jupyter-repo2docker --no-build` renders the Dockerfile Binder would build from this checkout, offline:
it needs no Docker daemon (the fixture points DOCKER_HOST at nothing to prove it) and no network.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from helpers import wait_for_server  # tests/helpers.py

REPO = Path(__file__).resolve().parents[1]
BINDER = REPO / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[str, str]:
    """(Dockerfile, log) as repo2docker renders them for this checkout."""
    r2d = Path(sys.executable).with_name("jupyter-repo2docker")
    if not r2d.exists():
        pytest.skip("jupyter-repo2docker is not installed; it is in the dev extras (`make test` installs it)")
    proc = subprocess.run(
        [str(r2d), "--no-build", "--no-run", str(REPO)],
        cwd=tmp_path_factory.mktemp("r2d"),  # away from any repo2docker_config.py in the caller's cwd
        env={**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, f"repo2docker could not render binder/:\n{proc.stderr[-3000:]}"
    assert proc.stdout.lstrip().startswith("FROM "), proc.stdout[:500]
    return proc.stdout, proc.stderr


def _requirement_lines() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [line.split(" #")[0].strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_torch_is_pinned_to_a_cpu_build_inside_the_packages_range():
    lines = _requirement_lines()
    assert f"--extra-index-url {CPU_INDEX}" in lines
    assert not [line for line in lines if line.startswith(("--index-url", "-i "))], "keep PyPI for the rest"
    torch = [Requirement(line) for line in lines if not line.startswith("-") and Requirement(line).name == "torch"]
    assert len(torch) == 1, f"binder/requirements.txt should pin torch once, found {torch}"
    (spec,) = torch[0].specifier
    # An exact pin with the +cpu local version: only the CPU index serves it (PyPI takes no local versions),
    # so no resolver can choose a CUDA wheel.
    assert spec.operator == "==" and Version(spec.version).local == "cpu", f"pin torch==X.Y.Z+cpu, not {spec}"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (package_range,) = [Requirement(d).specifier for d in project["dependencies"] if Requirement(d).name == "torch"]
    assert Version(spec.version) in SpecifierSet(str(package_range)), (
        f"binder's torch {spec.version} is outside pyproject's torch{package_range}; postBuild would replace it")


def test_dockerfile_installs_the_requirements_with_no_pip_cache_before_copying_the_repo(rendered):
    dockerfile, log = rendered
    assert "Building conda environment for python=3.11" in log, "binder/runtime.txt should choose Python 3.11"
    install = re.search(r'^RUN .*/pip install --no-cache-dir -r "binder/requirements\.txt"$', dockerfile, re.M)
    assert install, "repo2docker no longer installs binder/requirements.txt with --no-cache-dir"
    copy_repo = dockerfile.index("COPY --chown=0:0 src/ ")
    # Before the repository is copied in: the torch layer is reused by builds of later commits.
    assert install.start() < copy_repo


def test_dockerfile_runs_postbuild_which_installs_the_package_with_no_pip_cache(rendered):
    dockerfile, _ = rendered
    assert re.search(r"^RUN \./binder/postBuild$", dockerfile, re.M), "repo2docker did not pick up postBuild"
    post_build = BINDER / "postBuild"
    assert os.access(post_build, os.X_OK)
    subprocess.run(["bash", "-n", str(post_build)], check=True)
    script = post_build.read_text()
    assert "set -euo pipefail" in script  # a failed install fails the build, not the first notebook
    installs = [line.strip() for line in script.splitlines() if re.match(r"\s*(python -m )?pip install", line)]
    assert installs, "postBuild installs nothing"
    for line in installs:
        assert "--no-cache-dir" in line, f"postBuild's `{line}` keeps pip's cache in the image"
    # The package itself, not editable: the wheel's labextension and server config land in the env.
    assert any(line.split()[-1] == "." and "-e" not in line.split() for line in installs), installs


# --------------------------------------------------------------------------------------------------
# JupyterLab opens in notebooks/: the server config postBuild installs, read by a real server
# --------------------------------------------------------------------------------------------------

SERVER_CONFIG = BINDER / "jupyter_server_config.py"


def test_postbuild_installs_the_server_config_as_the_users_jupyter_config():
    script = (BINDER / "postBuild").read_text()
    assert 'config_dir="$(jupyter --config-dir)"' in script
    assert 'cp binder/jupyter_server_config.py "$config_dir/jupyter_server_config.py"' in script


def _load_config(cwd: Path):
    from traitlets.config.loader import PyFileConfigLoader

    here = os.getcwd()
    os.chdir(cwd)
    try:
        return PyFileConfigLoader(SERVER_CONFIG.name, path=str(BINDER)).load_config()
    finally:
        os.chdir(here)


def test_the_config_applies_only_where_notebooks_exist(tmp_path):
    """preferred_dir must exist under the server's root (else the server refuses to start), so a server
    started elsewhere in the image (a terminal, another directory) gets none of it."""
    assert "default_url" not in _load_config(tmp_path).ServerApp
    cfg = _load_config(REPO)
    assert cfg.ServerApp.default_url == cfg.LabApp.default_url == "/lab/tree/notebooks"
    assert cfg.ContentsManager.preferred_dir == "notebooks"


@pytest.mark.timeout(90)
def test_a_server_with_the_binder_config_opens_lab_in_notebooks(tmp_path):
    """A real jupyter server (the ServerApp that jupyterhub-singleuser runs too), started in the repository
    with only the config postBuild installs: "/" redirects to /lab/tree/notebooks, and JupyterLab's file
    browser starts in notebooks/ (its page config's preferredPath)."""
    config = tmp_path / "config"
    config.mkdir()
    shutil.copy(SERVER_CONFIG, config / "jupyter_server_config.py")  # what postBuild does
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = uuid.uuid4().hex
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(config), JUPYTER_DATA_DIR=str(tmp_path / "data"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_PLATFORM_DIRS="1")
    cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           "--ServerApp.allow_root=True", "--ServerApp.terminals_enabled=False"]
    log = tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    def get(path: str, follow: bool = True):
        req = urllib.request.Request(url + path, headers={"Authorization": f"token {token}"})
        opener = urllib.request.build_opener() if follow else urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(req, timeout=10) as resp:
                return resp.status, resp.headers, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, ""

    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_server(proc, lambda: get("/api/status")[0] == 200, "jupyter server",
                        lambda: log.read_text(errors="replace")[-3000:], 60)
        status, headers, _ = get("/", follow=False)
        location = urllib.parse.urlsplit(headers.get("Location", "")).path
        assert status == 302 and location.endswith("/lab/tree/notebooks"), (status, dict(headers))
        status, _, page = get("/lab/tree/notebooks")
        assert status == 200 and re.search(r'"preferredPath":\s*"/?notebooks"', page), page[:2000]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
