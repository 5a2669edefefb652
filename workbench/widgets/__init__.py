"""Notebook views over the core: ipywidgets + plotly, thin (they call core APIs and render core objects).

The core never imports this package; importing it pulls in ipywidgets and plotly.
"""

from workbench.widgets.dashboard import RunDashboard
from workbench.widgets.plots import plot_losses, run_label

__all__ = ["RunDashboard", "plot_losses", "run_label"]
