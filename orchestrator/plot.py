"""Draw a run's history: loss and learning rate against the global micro-step, with every
preemption notice, restart and committed state marked (people read a run faster from a picture)."""

from __future__ import annotations

from orchestrator.timeline import restarts
from policies.journal import Journal, PreemptionNotice


def plot_run(journal: Journal, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for _, step in sorted(journal.steps().items())]
    xs = [s.global_micro_step for s in steps]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(xs, [s.loss for s in steps], color="tab:blue", label="loss")
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
    ax.set_title(title or "syncpoint run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
