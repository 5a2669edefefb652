"""Notebook views over the core: ipywidgets + plotly, thin (they call core APIs and render core objects).

The core never imports this package; importing it pulls in ipywidgets and plotly.
"""

from workbench.widgets.dashboard import RunDashboard
from workbench.widgets.plots import plot_losses, plot_pipeline_timeline, plot_tokens_per_expert, run_label

__all__ = ["RunDashboard", "plot_losses", "plot_pipeline_timeline", "plot_tokens_per_expert", "run_label"]

from workbench.widgets.checkpoint_browser import CheckpointBrowser  # noqa: E402

__all__ += ["CheckpointBrowser"]

from workbench.widgets.plan_view import ShardingPlanView  # noqa: E402

__all__ += ["ShardingPlanView"]
