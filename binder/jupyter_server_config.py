# Binder: open JupyterLab in notebooks/, the tutorials, instead of the repository's root.
# binder/postBuild installs this file as the image's user-level Jupyter server config.
#
# default_url is where the server sends a visitor of "/" (the Binder link without ?urlpath=);
# preferred_dir is where JupyterLab's file browser starts, also when a launcher passes its own
# --ServerApp.default_url=/lab (repo2docker's local run does). preferred_dir must exist under the
# server's root, or the server refuses to start, so both apply only where notebooks/ is there.
import os

c = get_config()  # noqa: F821 (defined by Jupyter when it loads this file)

if os.path.isdir("notebooks"):
    c.ServerApp.default_url = "/lab/tree/notebooks"
    c.LabApp.default_url = "/lab/tree/notebooks"  # `jupyter lab` hands its own default_url to the server
    c.ContentsManager.preferred_dir = "notebooks"
