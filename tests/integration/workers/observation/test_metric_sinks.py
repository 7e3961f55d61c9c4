"""Metrics where people look (issue 17.3): Ray Train's report, TensorBoard, the terminal's bar.

Real parts: in-process runs of the example job write real TensorBoard event files (to a local run
directory and to memory://), read back with TensorBoard's own ``EventAccumulator``, whose purge
rule decides what a resumed run's curves show; the bar is rich rendering to a string. Ray's own
delivery of the report is checked in tests/ray/test_first_hour.py's embedded-Ray run.
"""

from __future__ import annotations

import io
import os
import time
import uuid
from collections import Counter

import numpy as np
import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from syncpoint.orchestrator.progress_bar import (
    RAY_JOB_ENV,
    EventFollower,
    RunView,
    live_progress,
    make_progress,
    show,
    show_progress_bar,
)
from syncpoint.policies.contracts.journal import AttemptStarted, Finished, Progress, ProgressRecord, StateCommitted
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.observation.metric_sinks import TENSORBOARD_DIR, step_values
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_in_process
from tests.helpers import digest, lm_spec, run, run_until_crash, state_names, step_history, trainer_json, with_overrides

# 10 micro-batches per epoch, accumulation 4: optimizer steps at micro-steps 4, 8, 10, 14, 18, 20;
# a state every 2 optimizer steps (micro-steps 8, 14, 20); every step logged.
SETS = (
    "task.config.num_samples=20",
    "train.grad_accum=4",
    "train.epochs=2",
    "deepspeed.zero_stage=0",
    "checkpoint.save_every={value: 2, unit: optimizer_steps}",
    "train.log_every=1",
)
# A crash after micro-step 13: step 3 (micro-step 10) was logged after the last commit (step 2, micro-step 8),
# so the resumed attempt recomputes it: the old point must not show.
CRASH = "faults=[{at_micro_step: 13, mode: raise}]"
REFERENCE: dict = {}


def _reference(tmp_path_factory):
    if not REFERENCE:
        spec = lm_spec(tmp_path_factory.mktemp("ref"), *SETS)
        REFERENCE["spec"], REFERENCE["final"] = spec, run(spec).final_state
    return REFERENCE["spec"], REFERENCE["final"]


def _local_copy(spec, tmp) -> str:
    """The run's tensorboard directory as local files (a memory:// run's too), for TensorBoard's readers."""
    storage, out = RunStorage(spec.run_url), tmp / f"tb-{uuid.uuid4().hex[:6]}"
    out.mkdir()
    for name in storage.list_files(TENSORBOARD_DIR):
        (out / name).write_bytes(storage.read_bytes(TENSORBOARD_DIR, name, limit=1 << 30))
    return str(out)


def _accumulator(logdir: str) -> EventAccumulator:
    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every point
    acc.Reload()
    return acc


def _curve(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _raw_steps(logdir: str, tag: str) -> Counter:
    """How often each step of a tag was written, over every file, before TensorBoard's purge."""
    seen: Counter = Counter()
    for name in sorted(os.listdir(logdir)):
        for event in EventFileLoader(os.path.join(logdir, name)).Load():
            if event.HasField("summary"):
                seen.update(event.step for v in event.summary.value if v.tag == tag)
    return seen


def test_tensorboard_of_an_uninterrupted_run(tmp_path, tmp_path_factory):
    ref, _ = _reference(tmp_path_factory)
    logdir = _local_copy(ref, tmp_path)
    assert os.listdir(logdir) == ["events.out.tfevents.attempt-000001.syncpoint"]  # one file per attempt
    acc = _accumulator(logdir)
    history = step_history(ref)
    assert _curve(acc, "loss") == [(s, np.float32(history[s].loss)) for s in range(1, 7)]
    assert _curve(acc, "lr") == [(s, np.float32(history[s].lr)) for s in range(1, 7)]
    assert [s for s, v in _curve(acc, "samples_per_s")] == list(range(1, 7))
    assert all(v > 0 for _, v in _curve(acc, "samples_per_s"))
    commits = EventLog(RunStorage(ref.run_url)).journal().commits
    assert _curve(acc, "save/blocked_seconds") == [(c.optimizer_step, np.float32(c.blocked_seconds)) for c in commits]
    assert [c.optimizer_step for c in commits] == [2, 4, 6]
    assert "restarts/text_summary" not in acc.Tags()["tensors"]  # a first attempt is not a restart


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_resumed_run_continues_the_curves(tmp_path, tmp_path_factory, where):
    """After TensorBoard's purge (the resumed attempt's file starts at the resumed step + 1), each step
    has one point, equal to the uninterrupted run's; the recomputed step really was written twice."""
    ref, ref_final = _reference(tmp_path_factory)
    storage = tmp_path / "run" if where == "local" else f"memory://tb-{uuid.uuid4().hex}"
    spec = lm_spec(storage, *SETS, CRASH)
    assert run_until_crash(spec)
    result = run(spec)
    assert result.resumed_from == f"{8:012d}" and digest(spec, result.final_state) == digest(ref, ref_final)
    logdir = _local_copy(spec, tmp_path)
    assert sorted(os.listdir(logdir)) == [
        "events.out.tfevents.attempt-000001.syncpoint",
        "events.out.tfevents.attempt-000002.syncpoint",
    ]
    assert _raw_steps(logdir, "loss") == Counter({1: 1, 2: 1, 3: 2, 4: 1, 5: 1, 6: 1})  # step 3 twice on disk
    acc, expected = _accumulator(logdir), _accumulator(_local_copy(ref, tmp_path))
    for tag in ("loss", "lr"):
        curve = _curve(acc, tag)
        assert [s for s, _ in curve] == list(range(1, 7)), tag  # no duplicate, no backward point
        assert curve == _curve(expected, tag), tag
    restarts = acc.Tensors("restarts/text_summary")
    assert [e.step for e in restarts] == [2]
    text = restarts[0].tensor_proto.string_val[0].decode()
    assert "attempt 2 (a new submission): resumed from state 000000000008 at optimizer step 2" in text


def test_metrics_do_not_change_training(tmp_path, tmp_path_factory):
    """Writing every step (TensorBoard, reports) or almost never: the same trajectory, bit for bit."""
    ref, ref_final = _reference(tmp_path_factory)
    quiet = with_overrides(lm_spec(tmp_path, *SETS), "train.log_every=1000")
    reports: list[dict] = []
    result = run_in_process(quiet, print_progress=False, report_metrics=reports.append)
    assert digest(quiet, result.final_state) == digest(ref, ref_final)
    assert [r["optimizer_step"] for r in reports] == [6]  # the last step is always logged


def test_ray_report_at_every_logged_step(tmp_path):
    """The launcher's report function gets every logged step (train.log_every and the last), with the
    step, the agreed loss, the learning rate and throughput: plain floats."""
    spec = lm_spec(tmp_path, *SETS, "train.log_every=4")
    reports: list[dict] = []
    run_in_process(spec, print_progress=False, report_metrics=reports.append)
    history = step_history(spec)
    assert [r["optimizer_step"] for r in reports] == [4, 6]
    # the run's last boundary also evaluates (the example's eval_every): one report carries both
    # the example's AdamW splits off biases and norms (train.optimizer.no_decay): two groups
    assert set(reports[0]) == {"optimizer_step", "loss", "lr", "lr_group_0", "lr_group_1", "samples_per_s"}
    assert set(reports[1]) == set(reports[0]) | {"eval_loss"}
    for r in reports:
        assert all(type(v) is float for k, v in r.items() if k != "optimizer_step")
        assert (r["loss"], r["lr"]) == (history[r["optimizer_step"]].loss, history[r["optimizer_step"]].lr)


def test_ray_reports_no_more_often_than_ray_collects_them(tmp_path, monkeypatch):
    """Ray's controller collects one report per worker per poll and a worker's next report waits for
    it: logged steps reach Ray at most every REPORT_EVERY_S (agreed by the boundary vote), the last
    step always; TensorBoard still gets every logged step."""
    import syncpoint.workers.observation.metric_sinks as sinks

    monkeypatch.setattr(sinks, "REPORT_EVERY_S", 3600.0)
    spec = lm_spec(tmp_path, *SETS, "train.log_every=1")
    reports: list[dict] = []
    run_in_process(spec, print_progress=False, report_metrics=reports.append)
    assert [r["optimizer_step"] for r in reports] == [1, 6]  # the first logged step, then the last
    acc = _accumulator(_local_copy(spec, tmp_path))
    assert [step for step, _ in _curve(acc, "loss")] == [1, 2, 3, 4, 5, 6]
    # the final evaluation (the example's eval_every): in TensorBoard, and in the last report, as the state has it
    final = trainer_json(spec, max(state_names(spec)))["metrics"]["eval_loss"]
    assert _curve(acc, "eval_loss") == [(6, pytest.approx(final))] and reports[-1]["eval_loss"] == final


def test_step_values_per_parameter_group():
    record = {"optimizer_step": 3, "global_micro_step": 12, "loss": 2.5, "lr": 0.1}
    assert step_values(record, 10.0) == {"loss": 2.5, "lr": 0.1, "samples_per_s": 10.0}
    grouped = step_values({**record, "lrs": [0.1, 0.01]}, 10.0)
    assert grouped == {"loss": 2.5, "lr": 0.1, "lr_group_0": 0.1, "lr_group_1": 0.01, "samples_per_s": 10.0}


# ---------------------------------------------------------------- the terminal's progress bar


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_the_bar_only_on_a_terminal():
    assert show_progress_bar(_Stream(True), {"TERM": "xterm-256color"})
    assert not show_progress_bar(_Stream(False), {"TERM": "xterm-256color"})  # a pipe, a file, a test
    assert not show_progress_bar(_Stream(True), {RAY_JOB_ENV: "{}"})  # `ray job submit`: the output is a log
    assert not show_progress_bar(_Stream(True), {"TERM": "dumb"})
    assert not show_progress_bar(object(), {})  # not a stream at all


def _events(t0: float = 1000.0) -> list:
    def rec(step: int, t: float) -> ProgressRecord:
        return ProgressRecord(
            optimizer_step=step, global_micro_step=4 * step, epoch=0, loss=3.0 - step / 10, lr=0.1, time=t
        )

    return [
        StateCommitted(
            time=t0 - 500,
            attempt=1,
            state="000000000016",
            global_micro_step=16,
            optimizer_step=4,
            bytes=1,
            seconds=1.0,
            blocked_seconds=1.0,
            committed_at_micro_step=16,
            reasons=["interval"],
        ),
        Progress(time=t0 - 400, attempt=1, records=[rec(9, t0 - 401)]),  # an earlier submission's
        AttemptStarted(
            time=t0 + 1,
            attempt=2,
            world_size=2,
            resumed_from="000000000016",
            global_micro_step=16,
            optimizer_step=4,
            total_steps=48,
        ),
        Progress(time=t0 + 5, attempt=2, records=[rec(5, t0 + 2.0), rec(6, t0 + 3.0), rec(7, t0 + 4.0)]),
        StateCommitted(
            time=t0 + 6,
            attempt=2,
            state="000000000032",
            global_micro_step=32,
            optimizer_step=8,
            bytes=1,
            seconds=1.0,
            blocked_seconds=0.5,
            committed_at_micro_step=32,
            reasons=["interval"],
        ),
        Progress(time=t0 + 7, attempt=2, records=[rec(8, t0 + 5.0)]),
    ]


def test_the_view_folds_the_event_log():
    view, since = RunView(micro_batch_size=8), 1000.0
    for e in _events(since)[:2]:
        view.fold(e, current=e.time >= since)
    assert (view.attempt, view.step, view.loss, view.newest_state) == (None, 0, None, "000000000016")
    for e in _events(since)[2:4]:
        view.fold(e)
    # steps 5 to 7 of the first batch: 2 steps x 4 micro-steps x 8 samples x 2 ranks in 2 s
    assert (view.attempt, view.step, view.total, view.samples_per_s) == (2, 7, 48, 2 * 4 * 8 * 2 / 2.0)
    for e in _events(since)[4:]:
        view.fold(e)
    assert (view.step, view.loss, view.newest_state) == (8, pytest.approx(2.2), "000000000032")
    assert view.samples_per_s == 4 * 8 * 2 / 1.0  # since the previous batch's last record
    view.fold(Finished(time=since + 9, attempt=2, state="000000000192", global_micro_step=192, optimizer_step=48))
    assert view.finished and view.step == 48


def test_the_bar_renders_step_loss_speed_eta_and_newest_state():
    out, clock = io.StringIO(), [0.0]
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    progress = make_progress(console, get_time=lambda: clock[0])
    task = progress.add_task("starting", total=None, loss="", speed="", state="")
    view, events = RunView(micro_batch_size=8), _events()
    for e in events[:3]:  # the attempt starts at step 4 of 48
        view.fold(e, current=e.time >= 1000.0)
    show(progress, task, view, new_attempt=True)
    for t, new in ((3.0, events[3:4]), (4.0, events[4:])):  # polls: step 7 at 3 s, step 8 at 4 s
        clock[0] = t
        for e in new:
            view.fold(e)
        show(progress, task, view)  # rich's speed: the steps after its first sample, 1 step/s: 40 s left
    console.print(progress.get_renderable())
    text = out.getvalue()
    for part in ("attempt 2", "step", " 8/48", "loss 2.2000", "64 samples/s", "ETA 0:00:40", "state 000000000032"):
        assert part in text, (part, text)


def test_the_live_bar_follows_a_run_log(tmp_path):
    """The polling thread reads each event file once and shows the newest step; it stops with the run."""
    storage = RunStorage(str(tmp_path / "run"))
    log = EventLog(storage)
    since = time.time()
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    with live_progress(storage, since=since, micro_batch_size=8, console=console, poll_s=0.02) as view:
        log.emit(
            AttemptStarted(
                attempt=1,
                world_size=1,
                nodes=[""],
                submission="s",
                resumed_from=None,
                global_micro_step=0,
                optimizer_step=0,
                total_steps=10,
            )
        )
        log.emit(
            Progress(
                attempt=1,
                records=[
                    ProgressRecord(optimizer_step=3, global_micro_step=12, epoch=0, loss=1.5, lr=0.1, time=time.time())
                ],
            )
        )
        deadline = time.monotonic() + 10
        while view.step != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert (view.attempt, view.step, view.total, view.loss) == (1, 3, 10, 1.5)
    assert "3/10" in out.getvalue() and "loss 1.5000" in out.getvalue()
    follower = EventFollower(storage)
    assert len(follower.new_events()) == 2 and follower.new_events() == []  # each file read once


def test_the_live_bar_shows_each_evaluation_above_it_and_the_lr_and_epoch_in_it(tmp_path):
    """With the bar the workers print no lines of their own: each evaluation of this submission is
    printed above the bar as the worker's line; the bar carries the newest step's LR and epoch."""
    from syncpoint.policies.contracts.journal import Evaluated

    storage = RunStorage(str(tmp_path / "run"))
    log = EventLog(storage)
    log.emit(Evaluated(attempt=1, optimizer_step=2, global_micro_step=8, metrics={"loss": 9.0}, seconds=0.1))
    since = time.time() + 0.01  # the evaluation above is an earlier submission's: not shown again
    time.sleep(0.02)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    with live_progress(storage, since=since, micro_batch_size=8, console=console, poll_s=0.02, epochs=2) as view:
        log.emit(
            AttemptStarted(
                attempt=1,
                world_size=1,
                nodes=[""],
                submission="s",
                resumed_from=None,
                global_micro_step=0,
                optimizer_step=0,
                total_steps=10,
            )
        )
        log.emit(
            Progress(
                attempt=1,
                records=[
                    ProgressRecord(
                        optimizer_step=3, global_micro_step=12, epoch=1, loss=1.5, lr=0.00125, time=time.time()
                    )
                ],
            )
        )
        log.emit(
            Evaluated(
                attempt=1, optimizer_step=3, global_micro_step=12, metrics={"loss": 1.25, "acc": 0.5}, seconds=0.1
            )
        )
        deadline = time.monotonic() + 10
        while "eval loss" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    text = out.getvalue()
    assert "[syncpoint] attempt 1 step 3 eval acc 0.5 loss 1.25 (0.10 s)" in text, text[:2000]
    assert "step 2 eval" not in text
    assert "epoch 2/2" in text and "lr 0.00125" in text, text[-2000:]
    assert view.lr == 0.00125 and view.epoch == 1
