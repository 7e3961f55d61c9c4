"""The live progress bar of ``syncpoint run`` in a terminal.

Why in the driver, from the event log: the terminal belongs to the driver, while the steps happen
in Ray workers whose prints reach it as log lines. Every fact the bar shows is already in the run's
event log (``syncpoint.policies.contracts.journal``): ``attempt_started`` (the attempt, its start and the run's total
steps), ``progress`` records (step, loss, time, flushed every few seconds and at every commit) and
``state_committed`` (the newest state). So a thread polls the log about once a second, reading only
the event files it has not seen, and the workers are told not to print their own progress lines.

Where nobody watches a terminal (stdout a pipe or a file, ``ray job submit``'s driver, whose output
is a log) the bar never starts and the workers print today's plain lines: ``show_progress_bar``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TextIO, TypedDict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Evaluated,
    Event,
    Finished,
    StateCommitted,
    UnknownEvent,
    read_event,
)
from syncpoint.policies.contracts.journal import Progress as ProgressEvent
from syncpoint.policies.decisions.evaluation import eval_line
from syncpoint.workers.observation.events import Unreadable, event_files, read_record
from syncpoint.workers.storage import RunStorage

POLL_S = 1.0
# Set by Ray's job supervisor in the environment of a `ray job submit` entrypoint (ray._private.
# runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR): the driver's output is the job's log.
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def show_progress_bar(stdout: TextIO, environ: Mapping[str, str]) -> bool:
    """Whether ``syncpoint run`` shows the live bar: only on a terminal, never under a Ray job or on
    a dumb terminal (plain lines there)."""
    if RAY_JOB_ENV in environ or environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stdout, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


@dataclass
class RunView:
    """What the bar shows, folded from the run's events in time order."""

    attempt: int | None = None
    step: int = 0
    total: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    newest_state: str | None = None
    lr: float | None = None  # the first param group's, at the newest step
    epoch: int | None = None  # 0-based, at the newest step
    epochs: int | None = None  # the run's (train.epochs), None when it is bounded by steps only
    micro_batch_size: int = 1
    world_size: int = 1
    finished: bool = False
    _last: tuple[int, float] | None = field(default=None, repr=False)  # (micro-step, time) of the last record

    def fold(self, event: Event | UnknownEvent, current: bool = True) -> None:
        """Take one event into the view; events of earlier submissions (``current`` False) only
        tell which state is newest."""
        if isinstance(event, StateCommitted):
            self.newest_state = event.state
        if not current:
            return
        if isinstance(event, AttemptStarted):
            self.attempt, self.step, self.world_size = event.attempt, event.optimizer_step, event.world_size
            self.total = event.total_steps or self.total
            self.loss = self.samples_per_s = self._last = None
            self.finished = False
        elif isinstance(event, ProgressEvent) and event.records:
            records = sorted(event.records, key=lambda r: r.global_micro_step)
            first = self._last or (records[0].global_micro_step, records[0].time)
            last = records[-1]
            if last.time > first[1] and last.global_micro_step > first[0]:
                self.samples_per_s = (
                    (last.global_micro_step - first[0])
                    * self.micro_batch_size
                    * self.world_size
                    / (last.time - first[1])
                )
            self.step, self.loss, self._last = last.optimizer_step, last.loss, (last.global_micro_step, last.time)
            self.lr, self.epoch = last.lr, last.epoch
        elif isinstance(event, Finished):
            self.step, self.finished = event.optimizer_step, True


def make_progress(console: Console, get_time: Callable[[], float] | None = None) -> Progress:
    """The bar: attempt, epoch, bar, step/total, loss, learning rate, samples/s, ETA (rich's estimate
    from the steps of the last 30 s), newest committed state."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        TextColumn("{task.fields[epoch]}"),
        BarColumn(),
        TextColumn("step"),
        MofNCompleteColumn(),
        TextColumn("{task.fields[loss]}"),
        TextColumn("{task.fields[lr]}"),
        TextColumn("{task.fields[speed]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[state]}"),
        console=console,
        transient=False,
        get_time=get_time,
    )


class BarFields(TypedDict):
    """What ``show`` puts on the bar: its description and the text of each field its columns show."""

    description: str
    loss: str
    lr: str
    epoch: str
    speed: str
    state: str


def show(progress: Progress, task: TaskID, view: RunView, *, new_attempt: bool = False) -> None:
    """Put the view on the bar. A new attempt resets the bar's speed estimate (a resumed attempt
    starts where its state was, often behind the last attempt's step)."""
    fields: BarFields = {
        "description": ("finished" if view.finished else f"attempt {view.attempt}" if view.attempt else "starting"),
        "loss": f"loss {view.loss:.4f}" if view.loss is not None else "loss -",
        "lr": f"lr {view.lr:.3g}" if view.lr is not None else "lr -",
        "epoch": (f"epoch {view.epoch + 1}" + (f"/{view.epochs}" if view.epochs else ""))
        if view.epoch is not None
        else "",
        "speed": f"{view.samples_per_s:,.0f} samples/s" if view.samples_per_s is not None else "- samples/s",
        "state": f"state {view.newest_state}" if view.newest_state else "no state yet",
    }
    if new_attempt:
        progress.reset(task, total=view.total, completed=view.step, **fields)
    else:
        progress.update(task, total=view.total, completed=view.step, **fields)


class EventFollower:
    """The run's event log, read incrementally: each poll lists the directory once and reads only
    the files it has not read yet (a file still being written is read again next time)."""

    def __init__(self, storage: RunStorage) -> None:
        self.storage, self.seen = storage, set[str]()

    def new_events(self) -> list[Event | UnknownEvent]:
        out = []
        for name in event_files(self.storage):
            if name in self.seen:
                continue
            record = read_record(self.storage, name)
            if isinstance(record, Unreadable) and record.partial:
                continue  # not whole yet: next poll
            self.seen.add(name)
            if not isinstance(record, Unreadable):
                out.append(read_event(record))
        return sorted(out, key=lambda e: e.time)


@contextlib.contextmanager
def polled(tick: Callable[[], object], every_s: float, name: str) -> Iterator[None]:
    """``tick`` every ``every_s`` on a daemon thread while the block runs, and once more at its end (the
    last look). What polls a run's log is a view (the bar, the metrics): an exception from ``tick`` shows
    nothing new, and the run goes on."""
    stop = threading.Event()

    def look() -> None:
        with contextlib.suppress(Exception):
            tick()

    def poll() -> None:
        while not stop.wait(every_s):
            look()

    thread = threading.Thread(target=poll, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
        look()


@contextlib.contextmanager
def live_progress(
    storage: RunStorage,
    *,
    since: float,
    micro_batch_size: int,
    console: Console | None = None,
    poll_s: float = POLL_S,
    epochs: int | None = None,
) -> Iterator[RunView]:
    """The bar while the block runs (``trainer.fit()``): a thread folds new events into the view
    every ``poll_s``; prints of the driver (Ray's log stream included) appear above the bar, and so
    does each evaluation, as the line a worker prints without the bar."""
    progress = make_progress(console or Console())
    view, follower = RunView(micro_batch_size=micro_batch_size, epochs=epochs), EventFollower(storage)
    task = progress.add_task("starting", total=None, loss="", lr="", epoch="", speed="", state="")

    def tick() -> None:
        shown_attempt = view.attempt
        for event in follower.new_events():
            current = event.time >= since
            view.fold(event, current=current)
            if current and isinstance(event, Evaluated):
                progress.console.print(
                    eval_line(event.attempt, event.optimizer_step, event.metrics, event.seconds),
                    markup=False,
                    highlight=False,
                )
        show(progress, task, view, new_attempt=view.attempt != shown_attempt)

    with progress, polled(tick, poll_s, "syncpoint-progress"):
        yield view
