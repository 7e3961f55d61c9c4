"""Draw a run's history: loss and learning rate against the global micro-step, with every
preemption notice, restart and committed state marked, and the run's goodput with its losses in a
box (people read a run faster from a picture).
Evaluations (``train.eval_every``) are points: ``loss`` on the loss axis, any other metric in a
panel of its own below (their scales are the task's).
The picture is rendered to bytes (``render_plot``): the run's own ``plot.png`` is written through
storage like every other file of the run, never by a library opening a path that may be a planted link."""

from __future__ import annotations

import io

from orchestrator.timeline import restarts
from policies.goodput import goodput
from policies.journal import Journal, PreemptionNotice


def plot_run(journal: Journal, path: str, title: str = "") -> None:
    """Draw the run into a file the user named (``syncpoint events --plot FILE.png``)."""
    data = render_plot(journal, title)
    with open(path, "wb") as f:
        f.write(data)


def render_plot(journal: Journal, title: str = "") -> bytes:
    """The run's picture as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for _, step in sorted(journal.steps().items())]
    xs = [s.global_micro_step for s in steps]
    evaluations = [e for _, e in sorted(journal.evaluations().items())]
    others = sorted({k for e in evaluations for k in e.metrics} - {"loss"})
    if others:
        fig, (ax, ax_eval) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[3, 2])
    else:
        fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(xs, [s.loss for s in steps], color="tab:blue", label="loss")
    with_loss = [e for e in evaluations if "loss" in e.metrics]
    if with_loss:
        ax.plot([e.global_micro_step for e in with_loss], [e.metrics["loss"] for e in with_loss], color="tab:purple",
                marker="o", linestyle="-", linewidth=1, label="eval loss")
    if others:
        for name in others:
            at = [e for e in evaluations if name in e.metrics]
            ax_eval.plot([e.global_micro_step for e in at], [e.metrics[name] for e in at], marker="o",
                         label=f"eval {name}")
        ax_eval.set_xlabel("global micro-step")
        ax_eval.set_ylabel("evaluation")
        ax_eval.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("global micro-step")
    ax.set_ylabel("loss", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [s.lr for s in steps], color="tab:gray", linestyle="--", label="learning rate")
    ax2.set_ylabel("learning rate", color="tab:gray")
    for i, commit in enumerate(journal.commits):
        ax.axvline(commit.global_micro_step, color="tab:green", alpha=0.35, linewidth=1,
                   label="state committed" if i == 0 else None)
    for i, notice in enumerate(journal.of_kind(PreemptionNotice)):
        ax.axvline(notice.global_micro_step, color="tab:orange", linestyle=":", linewidth=2,
                   label="preemption notice" if i == 0 else None)
    for i, r in enumerate(restarts(journal)):
        ax.axvline(r.previous_max_micro_step, color="tab:red", linewidth=2,
                   label="failure / restart" if i == 0 else None)
        ax.axvspan(r.resumed_micro_step, r.previous_max_micro_step, color="tab:red", alpha=0.12,
                   label="recomputed" if i == 0 else None)
    handles, labels = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(handles + h2, labels + l2, loc="upper right", fontsize=8)
    g = goodput(journal)
    if g is not None and g.total_s > 0:  # the run's goodput and where the rest of its wall time went
        shown = [f"goodput {100 * g.ratio:.1f}% ({g.productive_s:.1f} s of {g.total_s:.1f} s)"]
        shown += [f"{name} {seconds:.1f} s" for name, seconds in g.losses.items() if seconds > 0]
        ax.text(0.01, 0.02, "\n".join(shown), transform=ax.transAxes, fontsize=8, va="bottom", ha="left",
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "edgecolor": "tab:gray"})
    ax.set_title(title or "syncpoint run")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out.getvalue()
