"""``PPOBatchView``: a PPO batch plan drawn as its hierarchy, with the inputs editable.

    PPOBatchView(plan_ppo_batches(64, 4, "256 samples", "4 samples/rank", world_size=8, dp=4))

An icicle, one level per split, each box sized by samples: the rollout -> its mini-batches (one optimizer
step each, per epoch) -> each mini-batch's share per data-parallel rank -> that share's micro-batches
(gradient accumulation). Large plans draw the first mini-batch and the first rank in full and fold the
rest into one box per level, so the figure stays readable at any size. The form re-plans on every edit
through the core :func:`~workbench.rl.batch_plan.plan_ppo_batches`; an inexact ratio shows its one-line
message in place of the figure, and the last good plan stays drawn.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

from workbench.rl.batch_plan import PPOBatchPlan, plan_ppo_batches
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

_MAX_EXPANDED = 8  # boxes drawn per level before the rest are folded into one
# Each input's width: its label (at its natural width) and a field wide enough for its value.
_INPUT_WIDTH_PX = {"prompts": 190, "n": 190, "mini_batch": 230, "micro_batch": 260, "world_size": 150, "dp": 110,
                   "epochs": 160, "rollouts": 270, "group": 170}


def hierarchy(plan: PPOBatchPlan) -> dict[str, list]:
    """``ids, labels, parents, values`` (samples) of the icicle: rollout / mini-batch / rank / micro-batch."""
    ids, labels, parents, values = ["rollout"], [f"rollout: {plan.prompts_per_rollout} prompts x "
                                                f"{plan.samples_per_prompt} = {plan.samples_per_rollout} samples"], [""], \
        [plan.samples_per_rollout]

    def add(i: str, label: str, parent: str, value: int) -> None:
        ids.append(i)
        labels.append(label)
        parents.append(parent)
        values.append(value)

    K, dp, A = plan.mini_batches_per_epoch, plan.dp, plan.grad_accum
    M, Mr, m = plan.mini_batch_samples, plan.mini_batch_samples_per_rank, plan.micro_batch_samples_per_rank
    for k in range(min(K, _MAX_EXPANDED)):
        mb = f"mb{k}"
        add(mb, f"mini-batch {k}: {M} samples (optimizer step {k + 1} of {K} per epoch)", "rollout", M)
        if k:
            continue  # ranks and micro-batches drawn under the first mini-batch only
        for r in range(min(dp, _MAX_EXPANDED)):
            rk = f"{mb}/r{r}"
            add(rk, f"dp rank {r}: {Mr} samples", mb, Mr)
            if r:
                continue
            for a in range(min(A, _MAX_EXPANDED)):
                add(f"{rk}/m{a}", f"micro-batch {a}: {m} samples", rk, m)
            if A > _MAX_EXPANDED:
                rest = A - _MAX_EXPANDED
                add(f"{rk}/m+", f"{rest} more micro-batches ({rest * m} samples)", rk, rest * m)
        if dp > _MAX_EXPANDED:
            rest = dp - _MAX_EXPANDED
            add(f"{mb}/r+", f"{rest} more ranks ({rest * Mr} samples)", mb, rest * Mr)
    if K > _MAX_EXPANDED:
        rest = K - _MAX_EXPANDED
        add("mb+", f"{rest} more mini-batches ({rest * M} samples)", "rollout", rest * M)
    return {"ids": ids, "labels": labels, "parents": parents, "values": values}


class PPOBatchView:
    """The plan's hierarchy (``fig``), its derivation table (``table``) and a form to change the inputs."""

    def __init__(self, plan: PPOBatchPlan, *, mini_batch: str | None = None, micro_batch: str | None = None,
                 rollouts: int | None = None):
        self.plan = plan
        self.fig = PlotView(layout={"height": 360, "margin": {"l": 8, "r": 8, "t": 40, "b": 8}})
        self.fig.add_icicle(branchvalues="total", textinfo="label", **hierarchy(plan))
        self.message = widgets.HTML()
        self.table = widgets.HTML()
        style = {"description_width": "initial"}
        self.inputs = {
            "prompts": widgets.IntText(plan.prompts_per_rollout, description="prompts / rollout", style=style),
            "n": widgets.IntText(plan.samples_per_prompt, description="samples / prompt", style=style),
            "mini_batch": widgets.Text(mini_batch or f"{plan.mini_batch_samples} samples", description="mini-batch",
                                       style=style),
            "micro_batch": widgets.Text(micro_batch or f"{plan.micro_batch_samples_per_rank} samples/rank",
                                        description="micro-batch", style=style),
            "world_size": widgets.IntText(plan.world_size, description="world size", style=style),
            "dp": widgets.IntText(plan.dp, description="dp", style=style),
            "epochs": widgets.IntText(plan.ppo_epochs, description="PPO epochs", style=style),
            "rollouts": widgets.IntText(rollouts or plan.rollouts or 0, description="rollouts (0: no LR schedule)",
                                        style=style),
            "group": widgets.Checkbox(plan.group_samples, description="whole prompt groups", indent=False),
        }
        for key, w in self.inputs.items():
            w.layout.width = f"{_INPUT_WIDTH_PX[key]}px"
            w.observe(lambda _change: self.replan(), names="value")
        # One wrapping row: at a notebook's ~900 px the inputs take two lines, never a scrollbar.
        self.form = widgets.Box(list(self.inputs.values()), layout=widgets.Layout(flex_flow="row wrap", width="100%"))
        self.form.add_class("wb-ppo-form")
        self._draw(plan)
        self.widget = widgets.VBox([self.form, self.message, self.fig, self.table])

    def replan(self, **changes: Any) -> PPOBatchPlan | None:
        """Re-plan from the form (``changes`` set fields first, e.g. ``replan(mini_batch="96 samples")``);
        returns the new plan, or None with the one-line reason shown."""
        for key, value in changes.items():
            self.inputs[key].value = value  # each set re-plans through observe; the last one counts
        v = {k: w.value for k, w in self.inputs.items()}
        try:
            plan = plan_ppo_batches(v["prompts"], v["n"], v["mini_batch"], v["micro_batch"], world_size=v["world_size"],
                                    dp=v["dp"], ppo_epochs=v["epochs"], rollouts=v["rollouts"] or None,
                                    group_samples=v["group"])
        except ValueError as e:
            self.message.value = f"<span style='color:#cf222e'>{html.escape(str(e))}</span>"
            return None
        self.plan = plan
        self._draw(plan)
        return plan

    def _draw(self, plan: PPOBatchPlan) -> None:
        self.message.value = (f"<b>{plan.grad_accum}</b> micro-batches per optimizer step, "
                              f"<b>{plan.optimizer_steps_per_rollout}</b> optimizer steps per rollout"
                              + (f", <b>{plan.lr_schedule_steps}</b> LR-schedule steps" if plan.lr_schedule_steps else ""))
        with self.fig.batch_update():
            trace = self.fig.data[0]
            h = hierarchy(plan)
            trace.ids, trace.labels, trace.parents, trace.values = h["ids"], h["labels"], h["parents"], h["values"]
            self.fig.layout.title = (f"PPO batch hierarchy: {plan.samples_per_rollout} samples per rollout "
                                     f"over {plan.dp} data-parallel ranks")
        self.table.value = plan._repr_html_()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        p = self.plan
        return (f"PPOBatchView({p.samples_per_rollout} samples/rollout, {p.mini_batches_per_epoch} mini-batches, "
                f"accum {p.grad_accum})")
