"""The jupyter_server extension behind the JupyterLab views: ``/workbench/api/*`` answers from the core.

Installed with the package and enabled by ``etc/jupyter/jupyter_server_config.d/parallel_workbench.json``
(shipped as data files), so ``jupyter server extension list`` shows ``workbench.jupyter enabled``. The
routes and the shapes of their answers are in :mod:`workbench.jupyter.handlers`; the answers themselves in
``opening`` (which view opens a path), ``checkpoints``, ``timelines``, ``plans`` and ``runs``, over
``files`` (paths kept under the server's root, caches of parsed files, one-line refusals).
"""

from __future__ import annotations

from typing import Any

__all__ = ["_jupyter_server_extension_points", "_load_jupyter_server_extension"]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "workbench.jupyter"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Add the workbench routes, serving the same root directory as the contents API."""
    from workbench.jupyter.handlers import API_PREFIX, setup_handlers

    root = getattr(serverapp.contents_manager, "root_dir", None) or serverapp.root_dir
    setup_handlers(serverapp.web_app, root)
    serverapp.log.info("workbench: /%s/* serves checkpoints, memory snapshots, plans and runs under %s",
                       API_PREFIX, root)


# jupyter_server < 2 looked for this name
load_jupyter_server_extension = _load_jupyter_server_extension
