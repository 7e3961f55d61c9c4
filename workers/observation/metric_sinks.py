"""Metrics where people look: Ray Train's ``report`` and TensorBoard, behind one small seam.

Why a seam: the loop knows *what* happened at a step (loss, learning rates, throughput, a save's
cost, an evaluation's numbers); where that goes (Ray Train, TensorBoard, tomorrow another
tracker) is not its business. A ``MetricSink`` takes scalars and text by optimizer step; ``FanOut``
sends each call to several; ``RunMetrics`` is the loop's one handle on them.

Two kinds of sink, because they differ in who may call them:

* ``RayReport`` wraps ``ray.train.report``, which in Ray Train v2 is a barrier: every rank must
  call it, the same number of times, at the same steps (its docstring: "All workers must call
  ``ray.train.report`` the same number of times [...] This method acts as a barrier across all
  workers"); metrics without a checkpoint are fine (Ray's own example passes
  ``checkpoint=None`` on the other ranks). So it lives on every rank, and is called only at
  points every rank reaches: logged steps (``train.log_every`` and the last step) and evaluations.
* ``TensorBoardSink`` keeps the record: rank 0 only. It also gets what only the record wants (a
  save's blocked seconds, a restart as text), through ``RunMetrics.records``. So do the experiment
  trackers of ``train.report_to`` (MLflow, W&B: ``syncpoint.workers.observation.trackers``), which also hear of
  each committed state and end their tracker run with the attempt.

An evaluation's ``eval_*`` values join the boundary's values (``RunMetrics.at_boundary``): one
report per boundary, never two at one step.

Nothing here touches an RNG or the model: a run with metrics is bitwise the run without.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from syncpoint.workers.state.writer import SaveResult
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.training.attempt import Attempt

TENSORBOARD_DIR = "tensorboard"  # <run>/tensorboard: `tensorboard --logdir <run>/tensorboard`
UPLOAD_EVERY_S = 30.0  # how stale an object store's copy of the event file may get between commits
# Ray Train v2's controller collects one report per worker each health-check interval (2 s by
# default), and a worker's next report waits until the last one is collected: reporting more
# often would stall training. Logged steps reach Ray at most this often (TensorBoard gets all),
# and no more often than every 2 s where the interval is shorter (syncpoint shortens it for
# supervisors, to notice a dead worker sooner; each report is a barrier across the ranks).
REPORT_EVERY_S = max(2.0, float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0")))

ReportFn = Callable[[dict[str, float]], None]


class MetricSink(Protocol):
    """Where metrics go. ``step`` is the optimizer step the values belong to."""

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def text(self, step: int, tag: str, text: str) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Tracker(MetricSink, Protocol):
    """An experiment tracker (``syncpoint.workers.observation.trackers``): a sink that also records the last
    committed state and ends its tracker run with the attempt."""

    def state_committed(self, name: str, step: int) -> None: ...

    def end(self, ok: bool) -> None: ...


class FanOut:
    """Several sinks as one: each call goes to every sink, in order."""

    def __init__(self, sinks: Iterable[MetricSink] = ()) -> None:
        self.sinks = list(sinks)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        for s in self.sinks:
            s.scalars(step, values)

    def text(self, step: int, tag: str, text: str) -> None:
        for s in self.sinks:
            s.text(step, tag, text)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class RayReport:
    """``ray.train.report`` (injected by the Ray launcher: the loop never imports Ray). Every rank,
    same steps: see the module docstring. Only rank 0's values are what Ray Train keeps."""

    def __init__(self, report: ReportFn) -> None:
        self.report = report

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.report({"optimizer_step": step, **{k: float(v) for k, v in values.items()}})

    def text(self, step: int, tag: str, text: str) -> None:
        pass  # Ray Train's report takes metrics only

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Event files under ``<run>/tensorboard/``, one per attempt, on any storage URL.

    Why a local file uploaded whole: object stores cannot append, and a run directory may be
    ``memory://`` or ``s3://``. The writer writes to a private temp dir; ``flush`` copies the file
    to ``<run>/tensorboard/`` through ``RunStorage`` (at every commit, every ``UPLOAD_EVERY_S`` at
    logged steps, and at the end).

    Why ``purge_step``: a resumed attempt recomputes the steps after its state. The writer starts
    its file with a ``SessionLog.START`` at ``purge_step`` (the resumed optimizer step + 1), and
    TensorBoard, reading the files in name order, drops every earlier file's event at or after it:
    each step keeps one point, the one of the trajectory that continued. File names carry the
    zero-padded attempt number, so name order is attempt order.

    ``may_write``: False once rank 0 lost the run directory's lease (one fenced writer per run
    directory): from then on nothing is uploaded, as nothing else is written.
    """

    def __init__(
        self, storage: RunStorage, attempt: int, purge_step: int, may_write: Callable[[], bool] = lambda: True
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.storage, self.name = storage, f"events.out.tfevents.attempt-{attempt:06d}.syncpoint"
        self.may_write = may_write
        self._dir = tempfile.TemporaryDirectory(prefix="syncpoint-tensorboard-")
        self.writer = SummaryWriter(log_dir=self._dir.name, purge_step=purge_step, max_queue=100, flush_secs=3600)
        self.uploaded_size, self.closed = -1, False

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not self.closed:  # a closed SummaryWriter would open a second file
            for tag, value in values.items():
                self.writer.add_scalar(tag, float(value), global_step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        if not self.closed:
            self.writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        if not self.closed:
            self.writer.flush()
            self._upload()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.writer.close()  # writes what is queued
            self._upload()
        finally:
            self._dir.cleanup()

    def _upload(self) -> None:
        """Copy the attempt's event file to the run directory, if it grew since the last copy."""
        files = [f for f in os.listdir(self._dir.name) if "tfevents" in f]
        if len(files) != 1 or not self.may_write():
            return
        local = os.path.join(self._dir.name, files[0])
        if os.path.getsize(local) == self.uploaded_size:
            return
        with open(local, "rb") as f:
            data = f.read()
        self.storage.write_bytes(data, TENSORBOARD_DIR, self.name)
        self.uploaded_size = len(data)


def step_values(record: Mapping[str, Any], samples_per_s: float) -> dict[str, float]:
    """The scalars of one logged optimizer step: loss, the learning rate (``lr``: the first parameter
    group's, the same curve whatever the grouping; plus ``lr_group_<i>`` per group when there are
    several) and throughput. No key is another's prefix before a ``/``: MLflow's file store keeps
    each metric in a file named after its key, so ``lr`` beside ``lr/group_0`` could not be written."""
    values = {"loss": float(record["loss"]), "lr": float(record["lr"])}
    values.update({f"lr_group_{i}": float(lr) for i, lr in enumerate(record.get("lrs") or [])})
    values["samples_per_s"] = samples_per_s
    return values


class RunMetrics:
    """The loop's one handle on metrics for one attempt (a context manager: closed at the end,
    or on the way out of a failed attempt, uploading what it has).

    ``sinks`` get what every rank reports at the same points (logged steps, evaluations);
    ``records`` (rank 0's TensorBoard) get, in addition, saves and restarts."""

    def __init__(self, sinks: FanOut, records: FanOut, samples_per_micro_step: int, global_micro_step: int) -> None:
        self.sinks, self.records = sinks, records
        self.samples_per_micro_step = samples_per_micro_step
        self.last_time, self.last_micro_step = time.monotonic(), global_micro_step
        self.last_upload = time.monotonic()
        self.last_report = -float("inf")  # the first logged step reports

    @classmethod
    def open(
        cls,
        attempt: Attempt,
        report: ReportFn | None,
        *,
        state: str | None,
        optimizer_step: int,
        global_micro_step: int,
    ) -> RunMetrics:
        """The sinks of this rank: Ray Train's report where the launcher gave one (every rank), and
        TensorBoard on rank 0, continuing the curves from ``optimizer_step`` (the resumed one)."""
        lease = attempt.lease

        def may_write() -> bool:
            return lease is None or lease.lost is None

        records = FanOut()
        if attempt.rank == 0:
            from syncpoint.workers.observation.trackers import open_trackers

            if "tensorboard" in attempt.spec.train.report_to:
                records.sinks.append(TensorBoardSink(attempt.storage, attempt.number, optimizer_step + 1, may_write))
            records.sinks.extend(open_trackers(attempt, may_write))
        sinks = FanOut([*([RayReport(report)] if report is not None else []), *records.sinks])
        metrics = cls(sinks, records, attempt.spec.train.micro_batch_size * attempt.world_size, global_micro_step)
        if attempt.number > 1:
            how = "a restart of this submission" if attempt.restart else "a new submission"
            where = f"resumed from state {state} at optimizer step {optimizer_step}" if state else "started fresh"
            records.text(optimizer_step, "restarts", f"attempt {attempt.number} ({how}): {where}")
        return metrics

    def __enter__(self) -> RunMetrics:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for sink in self.records.sinks:
            if isinstance(sink, Tracker):  # the tracker run's status: finished, or failed until a resume
                sink.end(ok=kind is None)
        if kind is None:
            self.close()
            return
        try:  # a failed attempt: keep what it recorded, but its own error is the one that matters
            self.close()
        except Exception as e:  # noqa: BLE001 - any storage error here would mask the attempt's error
            print(
                f"[syncpoint] WARNING: TensorBoard events of the failed attempt not uploaded: {type(e).__name__}: {e}",
                file=sys.stderr,
                flush=True,
            )

    def report_due(self) -> bool:
        """This rank's vote: has ``REPORT_EVERY_S`` passed since its last report to Ray? The ranks
        agree through the boundary vote (clocks differ; Ray's report is a barrier)."""
        return time.monotonic() - self.last_report >= REPORT_EVERY_S

    def at_boundary(
        self,
        record: Mapping[str, Any],
        *,
        logged: bool,
        evaluated: Mapping[str, float] | None = None,
        report: bool = True,
    ) -> None:
        """A sync boundary (every rank, same arguments): ``record`` is the step's progress record
        (``optimizer_step``, ``global_micro_step``, ``loss``, ``lr``/``lrs``); a ``logged`` step
        contributes its scalars, an evaluation its ``eval_*`` values, in one report. ``report``
        (agreed by every rank): a logged step goes to Ray as well as to the record; an evaluation
        always does (it is rare, and Ray users watch it)."""
        values: dict[str, float] = {}
        now = time.monotonic()
        if logged:
            micro_step = int(record["global_micro_step"])
            samples_per_s = (
                (micro_step - self.last_micro_step) * self.samples_per_micro_step / max(now - self.last_time, 1e-9)
            )
            self.last_time, self.last_micro_step = now, micro_step
            values.update(step_values(record, samples_per_s))
        values.update(evaluated or {})
        if not values:
            return
        if report or evaluated:
            self.scalars(int(record["optimizer_step"]), values)
        else:
            self.records.scalars(int(record["optimizer_step"]), values)
        if now - self.last_upload > UPLOAD_EVERY_S:
            self.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Every rank, at the same steps (Ray's report is a barrier): logged steps and evaluations."""
        self.sinks.scalars(step, values)
        self.last_report = time.monotonic()

    def committed(self, result: SaveResult, reasons: list[str]) -> None:
        """A state committed: its cost, at the state's step, and an upload of the record so far."""
        self.records.scalars(
            result.optimizer_step, {"save/blocked_seconds": result.blocked_seconds, "save/seconds": result.seconds}
        )
        for sink in self.records.sinks:
            if isinstance(sink, Tracker):
                sink.state_committed(result.name, result.optimizer_step)
        self.flush()

    def flush(self) -> None:
        self.sinks.flush()
        self.last_upload = time.monotonic()

    def close(self) -> None:
        self.sinks.close()
