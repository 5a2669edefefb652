"""Notebook views over the core: ipywidgets + plotly, thin (they call core APIs and render core objects).

The core never imports this package. Importing it pulls in ipywidgets and plotly, and registers the
view of each core type with :mod:`workbench.display`, which imports this package by name the first
time a core object is displayed in a notebook.
"""

from workbench.checkpoint.manifest import CheckpointManifest
from workbench.display import register_view
from workbench.kernels.bench import KernelBench, KernelCheck
from workbench.memory.comparison import MemoryComparison
from workbench.memory.timeline import MemoryTimeline
from workbench.plan.types import ShardingPlan
from workbench.prediction.advise import Advice
from workbench.rl.batch_plan import PPOBatchPlan
from workbench.time.timeline import StepTimeline
from workbench.widgets.advisor_view import AdvisorView
from workbench.widgets.checkpoint_browser import CheckpointBrowser
from workbench.widgets.dashboard import RunDashboard
from workbench.widgets.kernel_view import KernelBenchView, KernelCheckView
from workbench.widgets.memory_view import MemoryComparisonView, MemoryTimelineView
from workbench.widgets.plan_view import ShardingPlanView
from workbench.widgets.rl_batch_view import PPOBatchView
from workbench.widgets.time_view import StepTimelineView
from workbench.widgets.plots import plot_losses, plot_pipeline_timeline, plot_tokens_per_expert, run_label

register_view(ShardingPlan, ShardingPlanView)
register_view(CheckpointManifest, CheckpointBrowser)
register_view(MemoryTimeline, MemoryTimelineView)
register_view(MemoryComparison, MemoryComparisonView)
register_view(KernelBench, KernelBenchView)
register_view(KernelCheck, KernelCheckView)
register_view(PPOBatchPlan, PPOBatchView)
register_view(StepTimeline, StepTimelineView)
register_view(Advice, AdvisorView)
# A Run has no widget of its own: it shows its summary table (Run._repr_html_); RunDashboard launches runs.

__all__ = ["RunDashboard", "CheckpointBrowser", "ShardingPlanView", "MemoryTimelineView", "MemoryComparisonView",
           "KernelBenchView", "KernelCheckView", "PPOBatchView", "StepTimelineView", "AdvisorView",
           "plot_losses", "plot_pipeline_timeline", "plot_tokens_per_expert", "run_label"]
