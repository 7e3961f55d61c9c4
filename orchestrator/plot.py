"""Draw a run's history: loss and every param group's learning rate against the optimizer step (the
x-axis TensorBoard uses), with every preemption notice, restart and committed state marked, and the
run's goodput with its losses in a box (people read a run faster from a picture). What happens
between two steps (a crash mid-cycle) sits at its fraction of the step, from its micro-step.
Evaluations (``train.eval_every``) are points: ``loss`` on the loss axis, any other metric in a
panel of its own below (their scales are the task's).
The picture is rendered to bytes (``render_plot``): the run's own ``plot.png`` is written through
storage like every other file of the run, never by a library opening a path that may be a planted link."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import TYPE_CHECKING

from syncpoint.orchestrator.timeline import goodput_headline, restarts
from syncpoint.policies.contracts.journal import Journal, PreemptionNotice, Step
from syncpoint.policies.decisions.goodput import goodput

if TYPE_CHECKING:
    from matplotlib.figure import Figure

X_LABEL = "optimizer step"


def plot_run(journal: Journal, path: str, title: str = "") -> None:
    """Draw the run into a file the user named (``syncpoint events --plot FILE.png``)."""
    data = render_plot(journal, title)
    with open(path, "wb") as f:
        f.write(data)


def render_plot(journal: Journal, title: str = "") -> bytes:
    """The run's picture as PNG bytes."""
    import matplotlib.pyplot as plt

    fig = draw(journal, title)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()


def draw(journal: Journal, title: str = "") -> Figure:
    """The run's figure (closed by the caller: ``plt.close``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for _, step in sorted(journal.steps().items())]
    xs = [s.optimizer_step for s in steps]
    at_step = step_of(steps)
    evaluations = [e for _, e in sorted(journal.evaluations().items())]
    others = sorted({k for e in evaluations for k in e.metrics} - {"loss"})
    if others:
        fig, (ax, ax_eval) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[3, 2])
    else:
        fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(xs, [s.loss for s in steps], color="tab:blue", label="loss")
    with_loss = [e for e in evaluations if "loss" in e.metrics]
    if with_loss:
        ax.plot(
            [e.optimizer_step for e in with_loss],
            [e.metrics["loss"] for e in with_loss],
            color="tab:purple",
            marker="o",
            linestyle="-",
            linewidth=1,
            label="eval loss",
        )
    if others:
        for name in others:
            at = [e for e in evaluations if name in e.metrics]
            ax_eval.plot(
                [e.optimizer_step for e in at], [e.metrics[name] for e in at], marker="o", label=f"eval {name}"
            )
        ax_eval.set_xlabel(X_LABEL)
        ax_eval.set_ylabel("evaluation")
        ax_eval.legend(loc="upper right", fontsize=8)
    ax.set_xlabel(X_LABEL)
    ax.set_ylabel("loss", color="tab:blue")
    ax2 = ax.twinx()
    rates = group_rates(steps)
    for group, values in enumerate(rates):
        ax2.plot(
            xs,
            values,
            color="tab:gray",
            linestyle=("--", ":", "-.")[group % 3],
            alpha=1.0 if group == 0 else 0.7,
            label="learning rate" if len(rates) == 1 else f"lr group {group}",
        )
    ax2.set_ylabel("learning rate", color="tab:gray")
    for i, commit in enumerate(journal.commits):
        ax.axvline(
            commit.optimizer_step,
            color="tab:green",
            alpha=0.35,
            linewidth=1,
            label="state committed" if i == 0 else None,
        )
    for i, notice in enumerate(journal.of_kind(PreemptionNotice)):
        ax.axvline(
            notice.optimizer_step,
            color="tab:orange",
            linestyle=":",
            linewidth=2,
            label="preemption notice" if i == 0 else None,
        )
    for i, r in enumerate(restarts(journal)):
        ax.axvline(
            at_step(r.previous_max_micro_step),
            color="tab:red",
            linewidth=2,
            label="failure / restart" if i == 0 else None,
        )
        ax.axvspan(
            at_step(r.resumed_micro_step),
            at_step(r.previous_max_micro_step),
            color="tab:red",
            alpha=0.12,
            label="recomputed" if i == 0 else None,
        )
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, loc="upper right", fontsize=8)
    g = goodput(journal)
    if g is not None and g.total_s > 0:  # the run's goodput and where the rest of its wall time went
        shown = [f"{goodput_headline(g)} ({g.productive_s:.1f} s of {g.total_s:.1f} s)"]
        shown += [f"{name} {seconds:.1f} s" for name, seconds in g.losses.items() if seconds > 0]
        ax.text(
            0.01,
            0.02,
            "\n".join(shown),
            transform=ax.transAxes,
            fontsize=8,
            va="bottom",
            ha="left",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "edgecolor": "tab:gray"},
        )
    ax.set_title(title or "syncpoint run")
    fig.tight_layout()
    return fig


def group_rates(steps: list[Step]) -> list[list[float]]:
    """Each param group's learning rate at every step (``lrs``, recorded when there are several groups;
    ``lr`` is the first group's): one list per group."""
    groups = max((len(s.lrs or ()) for s in steps), default=0) or 1
    return [
        [(s.lrs[g] if s.lrs and g < len(s.lrs) else s.lr if g == 0 else float("nan")) for s in steps]
        for g in range(groups)
    ]


def step_of(steps: list[Step]) -> Callable[[float], float]:
    """A global micro-step on the optimizer-step axis: interpolated between the recorded steps'
    micro-steps (a crash mid-cycle at its fraction of the step), extrapolated past the last one."""
    import numpy as np

    micro = np.array([0.0] + [float(s.global_micro_step) for s in steps])
    step = np.array([0.0] + [float(s.optimizer_step) for s in steps])

    def at(m: float) -> float:
        if len(micro) < 2 or m <= micro[-1]:
            return float(np.interp(m, micro, step))
        slope = (step[-1] - step[-2]) / max(micro[-1] - micro[-2], 1.0)
        return float(step[-1] + (m - micro[-1]) * slope)

    return at
