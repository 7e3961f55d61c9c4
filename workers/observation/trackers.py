"""Experiment trackers (MLflow, Weights & Biases) as metric sinks: one tracker run per syncpoint run.

``train.report_to`` names where rank 0 records the metrics: ``tensorboard``
(``syncpoint.workers.observation.metric_sinks.TensorBoardSink``), ``mlflow`` and ``wandb`` (here). Each tracker
is a ``MetricSink`` with two more calls: ``state_committed`` (the last committed state, as a tag or
summary) and ``end`` (the tracker run's status when an attempt ends).

Why a record in the run directory: a syncpoint run outlives its attempts and its submissions, and
each of them must continue the *same* tracker run. ``<run>/tracking.json`` holds a key (created
once, before any tracker run exists) and each tracker's run id; an MLflow run also carries the key
as the tag ``syncpoint.key``, so a run created by an attempt that died before writing its id is
found again by the tag, not created twice. W&B's run id is the key itself. The record is a small
JSON object read through the run storage with a bound and validated field by field (storage may be
hostile); a malformed one is reported and replaced, never trusted.

Why each step appears once: a resumed attempt recomputes the steps after its state, and a crashed
attempt may have logged some of them already. The tracker itself says what it holds when an
attempt opens it: MLflow's metric history (the last step of every key), W&B's resumed step online,
or the offline files of this run id (``offline_history``). A value at a step at or below that
high-water mark is not sent again (per key for MLflow, per run for W&B, whose steps are one axis);
since a resume is bitwise, the skipped value is the one already there (loss, lr, evaluations; a
timing such as ``samples_per_s`` keeps the first attempt's measurement). Every curve stays
monotonic, with one point per step.

W&B's steps must only go up, but a save commits while training goes on: its ``save/*`` values of
an earlier step are logged at the current step, against their own axis ``save/optimizer_step``.

Nothing here touches an RNG or the model: the Python, NumPy and torch generators are kept around
every tracker call, and only rank 0 holds trackers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import re
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from syncpoint.workers.observation.wandb_offline import (
    FINISH_WAIT_S,
    offline_files,
    offline_history,
    wait_until_written,
)

if TYPE_CHECKING:
    from syncpoint.policies.contracts.spec import JobSpec
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.training.attempt import Attempt

TRACKING = "tracking.json"
TRACKING_FORMAT = "syncpoint-tracking/1"
# One small JSON object (~300 bytes); a larger tracking.json is not one syncpoint wrote.
TRACKING_MAX_BYTES = 64 << 10
MLFLOW_DIR = "mlruns"  # <run>/mlruns: MLflow's file store when MLFLOW_TRACKING_URI is not set
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"  # MLflow 3 refuses a file store unless this is true
DATABASE_SCHEMES = ("postgresql", "mysql", "sqlite", "mssql")  # mlflow.store.db.db_types.DATABASE_ENGINES
KEY_TAG = "syncpoint.key"
# tracker -> (the module it needs, the extra that installs it)
EXTRAS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param's value
MAX_TAG_CHARS = 5000
_KEY = re.compile(r"^[0-9a-f]{32}$")
_RUN_ID = re.compile(r"^[0-9A-Za-z_-]{1,128}$")


def tracker_problems(spec: JobSpec, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Before anything starts (``syncpoint validate``/``run``/``drill``): one paragraph per tracker in
    ``train.report_to`` that cannot work here (its package missing, or MLflow without a place for its
    store)."""
    problems = []
    for name in spec.train.report_to:
        if name in EXTRAS and importlib.util.find_spec(EXTRAS[name][0]) is None:
            module, extra = EXTRAS[name]
            problems.append(
                f"train.report_to lists {name}, but the {module!r} package is not installed where syncpoint runs: "
                f"install it with pip install 'syncpoint[{extra}]' (on every node of the cluster), or remove "
                f"{name} from train.report_to"
            )
    if "mlflow" in spec.train.report_to:
        problem = mlflow_store_problem(spec, environ)
        if problem:
            problems.append(problem)
    return problems


def mlflow_store_problem(spec: JobSpec, environ: Mapping[str, str]) -> str | None:
    """Where MLflow would keep the run, if that fails only once the workers open it (minutes into a job,
    after the cluster started): MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is
    true (``mlflow.store.tracking.file_store.FileStore``) and fails on a value of it other than
    true/false/1/0; it has no database store without SQLAlchemy, which ``mlflow-skinny`` (what
    ``syncpoint[mlflow]`` installs) lacks. The URI's scheme is read as MLflow reads it
    (``mlflow.utils.uri.get_uri_scheme``), without importing MLflow: validate stays fast."""
    uri = environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri and not _local(spec):
        return (
            f"train.report_to lists mlflow and the storage {spec.storage!r} is not a local directory, so MLflow "
            "has no default place for its store (the default is <run>/mlruns on local storage): set "
            f"MLFLOW_TRACKING_URI to {_other_stores()}, or remove mlflow from train.report_to"
        )
    scheme = _mlflow_scheme(uri) if uri else ""
    if scheme in DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        return (
            f"train.report_to lists mlflow and MLFLOW_TRACKING_URI={uri!r} is a database, whose MLflow store needs "
            "SQLAlchemy, which is not installed where syncpoint runs (syncpoint[mlflow] installs mlflow-skinny, "
            "without it): pip install mlflow (on every node of the cluster), or set MLFLOW_TRACKING_URI to a "
            "tracking server (http://host:5000)"
        )
    return _file_store_problem(uri, environ.get(ALLOW_FILE_STORE)) if scheme == "" else None


def _file_store_problem(uri: str, allow: str | None) -> str | None:
    """MLflow's file store: MLFLOW_TRACKING_URI's (a path or ``file:``), or without it the run's own
    ``<run>/mlruns``, for which syncpoint sets MLFLOW_ALLOW_FILE_STORE=true unless it is set already."""
    value = None if allow is None else allow.lower()
    if value in ("true", "1") or (value is None and not uri):
        return None
    if value is not None and value not in ("false", "0"):
        return (
            f"train.report_to lists mlflow, whose file store reads {ALLOW_FILE_STORE}={allow!r} and fails on it "
            f"(MLflow takes true, false, 1 or 0): set {ALLOW_FILE_STORE}=true"
            + ("" if uri else ", or unset it (syncpoint allows the run's own <run>/mlruns itself)")
        )
    if not uri:
        return (
            f"train.report_to lists mlflow without MLFLOW_TRACKING_URI, so MLflow's store is the run's own file "
            f"store (<run>/mlruns), and {ALLOW_FILE_STORE}={allow} forbids file stores: unset {ALLOW_FILE_STORE} "
            f"(syncpoint allows this one store itself), or set MLFLOW_TRACKING_URI to {_other_stores()}"
        )
    return (
        f"train.report_to lists mlflow and MLFLOW_TRACKING_URI={uri!r} is a file store, which MLflow 3 refuses "
        f"unless {ALLOW_FILE_STORE}=true (the workers would fail once the job started): set {ALLOW_FILE_STORE}=true "
        f"beside it (it reaches the workers with the job), or set MLFLOW_TRACKING_URI to {_other_stores()}; "
        "unset, it is <run>/mlruns on local storage, which syncpoint allows itself"
    )


def _mlflow_scheme(uri: str) -> str:
    """The store MLflow picks for ``uri``: "" for its file store (a path, ``file:``, a Windows drive),
    the database's name for a database URL (``sqlite``, ``postgresql+psycopg2`` -> ``postgresql``),
    else the URI's scheme (``databricks``, ``uc``: MLflow's names without one)."""
    if uri in ("databricks", "databricks-uc", "uc"):
        return uri
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    database = next((db for db in DATABASE_SCHEMES if scheme.startswith(db)), None)
    if database:
        return database
    return "" if scheme == "file" or (len(scheme) == 1 and scheme.isalpha()) else scheme


def _other_stores() -> str:
    """The stores MLflow takes besides a file store, as installed here: a database only with SQLAlchemy."""
    if importlib.util.find_spec("sqlalchemy") is None:
        return "a tracking server (http://host:5000; a database URI such as sqlite:///... needs pip install mlflow)"
    return "a tracking server (http://host:5000) or a database (sqlite:///path/mlflow.db)"


def _local(spec: JobSpec) -> bool:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, _ = fsspec.core.url_to_fs(spec.run_url)
    except (ValueError, ImportError):
        return False
    return isinstance(fs, LocalFileSystem)


# ---- the record


class MlflowEntry(TypedDict):
    """The MLflow run this run logs to, and the store that holds it."""

    tracking_uri: str
    experiment_id: NotRequired[str]  # not checked when read: only the uri and run id are used
    run_id: str


class WandbEntry(TypedDict):
    """The W&B run this run logs to."""

    id: str
    project: NotRequired[str]


class TrackingRecord(TypedDict):
    """``<run>/tracking.json``: the key this run's tracker runs are tagged with, and each tracker's run."""

    format: str
    key: str
    mlflow: NotRequired[MlflowEntry]
    wandb: NotRequired[WandbEntry]


def read_record(storage: RunStorage, warn: Callable[[str], None]) -> TrackingRecord | None:
    """``<run>/tracking.json`` if it is one syncpoint wrote; ``None`` when absent, and reported when not
    a valid record (a tracker run is then created, as for a new run)."""
    if not storage.exists(TRACKING):
        return None
    try:
        record = json.loads(storage.read_bytes(TRACKING, limit=TRACKING_MAX_BYTES))
        problem = _record_problem(record)
    except Exception as e:  # noqa: BLE001 - a link, a huge file, bad JSON: each is a malformed record
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        return record
    warn(f"{TRACKING} is not a tracking record syncpoint wrote ({problem}): starting new tracker runs")
    return None


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict) or record.get("format") != TRACKING_FORMAT:
        return f"not a {TRACKING_FORMAT} object"
    if not isinstance(record.get("key"), str) or not _KEY.match(record["key"]):
        return "its key is not 32 hex digits"
    mlflow, wandb = record.get("mlflow"), record.get("wandb")
    if mlflow is not None:
        if not isinstance(mlflow, dict) or not all(isinstance(mlflow.get(k), str) for k in ("tracking_uri", "run_id")):
            return "its mlflow entry is not {tracking_uri, run_id}"
        if not _RUN_ID.match(mlflow["run_id"]):
            return "its mlflow run_id is not a run id"
    if wandb is not None and (not isinstance(wandb, dict) or not isinstance(wandb.get("id"), str)):
        return "its wandb entry is not {id}"
    if wandb is not None and not _RUN_ID.match(wandb["id"]):
        return "its wandb id is not a run id"
    return None


def new_record() -> TrackingRecord:
    """A new tracking record: a new key under which this run's tracker runs are found (kept in the run directory)."""
    return {"format": TRACKING_FORMAT, "key": uuid.uuid4().hex}


# ---- what goes to a tracker besides metrics


def flat_spec(spec: JobSpec) -> dict[str, str]:
    """The job spec as ``section.field`` -> text (URL credentials redacted, as ``syncpoint validate``
    prints it); lists and empty mappings as JSON."""
    from syncpoint.policies.contracts.spec import spec_to_json

    flat: dict[str, str] = {}

    def walk(obj: Any, prefix: str) -> None:
        if isinstance(obj, dict) and obj:
            for k, v in obj.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            text = obj if isinstance(obj, str) else json.dumps(obj, sort_keys=True)
            flat[prefix[:250]] = text[:MAX_PARAM_CHARS]

    walk(json.loads(spec_to_json(spec)), "")
    return flat


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """The Python, NumPy and torch (CPU, and CUDA where initialised) generators as they were: a tracker
    library that draws a random number (an id, a retry's jitter) cannot move the trajectory."""
    import numpy as np
    import torch

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class _Guarded:
    """A tracker's calls during training: an error is reported once and training goes on (a tracking
    server's outage must not stop the run, nor be silent)."""

    name = "tracker"
    warned = False

    def _call(self, what: str, fn: Callable[[], None]) -> None:
        try:
            with rng_kept():
                fn()
        except Exception as e:  # noqa: BLE001 - any tracker error; the run's own outcome is what counts
            if not self.warned:
                self.warned = True
                print(
                    f"[syncpoint] WARNING: {self.name}: {what} failed ({type(e).__name__}: {e}); training goes on, "
                    "later failures of this tracker are not reported",
                    file=sys.stderr,
                    flush=True,
                )


# ---- MLflow


class MlflowSink(_Guarded):
    """An MLflow run: metrics by optimizer step, the spec as params, the last state as a tag, restarts
    as tags ``restarts.attempt-<n>``."""

    name = "mlflow"

    def __init__(self, client: Any, run_id: str, attempt: int, logged: dict[str, int]) -> None:
        self.client, self.run_id, self.attempt = client, run_id, attempt
        self.logged = logged  # key -> the last step the tracker holds

    @staticmethod
    def tracking_uri(storage: RunStorage) -> str:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            return uri
        local = storage.local_path(MLFLOW_DIR)
        if local is None:  # refused before start (tracker_problems); here for the Python API's callers
            raise RuntimeError("train.report_to lists mlflow: set MLFLOW_TRACKING_URI (the storage is not local)")
        # MLflow 3 keeps its file store for those who ask for it: this default is one
        os.environ.setdefault(ALLOW_FILE_STORE, "true")
        return "file://" + os.path.abspath(local)

    @classmethod
    def open(cls, spec: JobSpec, storage: RunStorage, record: TrackingRecord, attempt: int) -> MlflowSink:
        from mlflow.tracking import MlflowClient

        uri = cls.tracking_uri(storage)
        client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or spec.name
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        run = None
        known = record.get("mlflow")
        if known and known["tracking_uri"] == uri:
            with contextlib.suppress(Exception):  # gone (deleted, another store): found by its tag or created
                run = client.get_run(known["run_id"])
        if run is None:
            found = client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{record['key']}'")
            run = found[0] if found else None
        if run is None:
            run = client.create_run(experiment_id, run_name=spec.name, tags={KEY_TAG: record["key"]})
        run_id = run.info.run_id
        record["mlflow"] = {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": run_id}
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        logged = {
            key: max((m.step for m in client.get_metric_history(run_id, key)), default=-1) for key in run.data.metrics
        }
        sink = cls(client, run_id, attempt, logged)
        sink._params(spec, run.data.params)
        client.set_tag(run_id, "syncpoint.attempts", str(attempt))
        return sink

    def _params(self, spec: JobSpec, held: Mapping[str, str]) -> None:
        """The spec as params; MLflow's params cannot change, so a value that changed since the run's
        first attempt is a tag ``spec.attempt-<n>.<field>`` instead."""
        from mlflow.entities import Param, RunTag

        flat = flat_spec(spec)
        params = [Param(k, v) for k, v in flat.items() if k not in held]
        changed = [
            RunTag(f"spec.attempt-{self.attempt:06d}.{k}"[:250], v) for k, v in flat.items() if held.get(k, v) != v
        ]
        for i in range(0, max(len(params), len(changed)), 100):  # MLflow takes 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100], tags=changed[i : i + 100])

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items() if step > self.logged.get(k, -1)]
        if metrics:
            self.logged.update({m.key: step for m in metrics})
            self._call("logging metrics", lambda: self.client.log_batch(self.run_id, metrics=metrics))

    def text(self, step: int, tag: str, text: str) -> None:
        key = f"{tag}.attempt-{self.attempt:06d}"
        self._call("setting a tag", lambda: self.client.set_tag(self.run_id, key, text[:MAX_TAG_CHARS]))

    def state_committed(self, name: str, step: int) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag("syncpoint.last_state", name), RunTag("syncpoint.last_state_step", str(step))]
        self._call("tagging the state", lambda: self.client.log_batch(self.run_id, tags=tags))

    def flush(self) -> None:
        pass  # MlflowClient writes at once

    def end(self, ok: bool) -> None:
        status = "FINISHED" if ok else "FAILED"
        self._call("ending the run", lambda: self.client.set_terminated(self.run_id, status))

    def close(self) -> None:
        pass


# ---- Weights & Biases


def wandb_dir(storage: RunStorage) -> str | None:
    """Where W&B writes its files: ``WANDB_DIR``, else the run directory when it is local (offline runs
    land in ``<run>/wandb/``), else W&B's own default (the working directory)."""
    return os.environ.get("WANDB_DIR") or storage.local_path()


class WandbSink(_Guarded):
    """A W&B run (id: the record's key), resumed with ``resume="allow"``: metrics by optimizer step, the
    spec as config, the last state and restarts in the summary."""

    name = "wandb"

    def __init__(self, run: Any, attempt: int, logged: int) -> None:
        self.run, self.attempt = run, attempt
        self.logged = logged  # the last step the tracker holds from earlier attempts
        self.step = -1  # the last step this attempt logged

    @classmethod
    def open(cls, spec: JobSpec, storage: RunStorage, record: TrackingRecord, attempt: int) -> WandbSink:
        import wandb

        known = record.get("wandb")
        run_id = (known.get("id") if known else None) or record["key"]
        record["wandb"] = {"id": run_id}
        where = wandb_dir(storage)
        held = max(
            (s for path in offline_files(where, run_id) for s in offline_history(path).steps), default=-1
        )  # offline: the files of earlier attempts are the tracker's record
        run = wandb.init(
            id=run_id,
            resume="allow",
            project=os.environ.get("WANDB_PROJECT") or spec.name,
            name=spec.name,
            dir=where,
            config=json.loads(_spec_json(spec)),
            reinit="create_new",
            settings=wandb.Settings(console="off"),
        )
        record["wandb"]["project"] = run.project or ""
        if run.resumed and run.step > 0:  # online: the server's next step
            held = max(held, run.step - 1)
        run.config.update({"syncpoint": {"attempts": attempt}}, allow_val_change=True)
        run.define_metric("save/*", step_metric="save/optimizer_step")
        return cls(run, attempt, held)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if step <= self.logged:
            return
        row = {k: float(v) for k, v in values.items()}
        if step < self.step:  # a save committed after later steps: at the current step, on its own axis
            row["save/optimizer_step"] = step
            step = self.step
        elif any(k.startswith("save/") for k in row):
            row["save/optimizer_step"] = step
        self.step = step
        self._call("logging metrics", lambda: self.run.log(row, step=step))

    def text(self, step: int, tag: str, text: str) -> None:
        key = f"{tag}/attempt-{self.attempt:06d}"
        self._call("writing the summary", lambda: self.run.summary.update({key: text}))

    def state_committed(self, name: str, step: int) -> None:
        values = {"syncpoint/last_state": name, "syncpoint/last_state_step": step}
        self._call("writing the summary", lambda: self.run.summary.update(values))

    def flush(self) -> None:
        pass  # W&B's service writes in the background

    def end(self, ok: bool) -> None:
        """Finish the W&B run, then wait (bounded) until its transaction log is written to its end: the
        next attempt reads it (``open``), and ``finish()`` may return before W&B's service wrote it."""
        path = getattr(getattr(self.run, "settings", None), "sync_file", None)
        self._call("finishing the run", lambda: self.run.finish(exit_code=0 if ok else 1))
        if path and os.path.isfile(path):  # none where W&B writes nothing here (WANDB_MODE=disabled)
            self._call("finishing the run", lambda: _written_or_raise(path))

    def close(self) -> None:
        pass


def _written_or_raise(path: str) -> None:
    if not wait_until_written(path):
        raise TimeoutError(f"its log {path} was not written to its end within {FINISH_WAIT_S:.0f} s")


def _spec_json(spec: JobSpec) -> str:
    from syncpoint.policies.contracts.spec import spec_to_json

    return spec_to_json(spec)


# ---- opening


def open_trackers(attempt: Attempt, may_write: Callable[[], bool]) -> list[MlflowSink | WandbSink]:
    """Rank 0's trackers of ``train.report_to``, each continuing this syncpoint run's tracker run; the
    record is written (once a tracker run id is new) only while the lease is ours.

    ``resume.policy: fresh`` outside a restart is a new trajectory: a new key, new tracker runs."""
    spec, storage = attempt.spec, attempt.storage
    wanted = [n for n in spec.train.report_to if n in EXTRAS]
    if not wanted:
        return []
    from syncpoint.policies.decisions.resume import starts_over

    fresh = starts_over(spec.resume.policy) and not attempt.restart
    record = None if fresh else read_record(storage, attempt.warn)
    if record is None:
        record = new_record()
        if may_write():
            storage.write_json(record, TRACKING)  # the key first: a run created below is found by it
    before = json.dumps(record, sort_keys=True)
    sinks: list[MlflowSink | WandbSink] = []
    with rng_kept():
        try:
            if "mlflow" in wanted:
                sinks.append(MlflowSink.open(spec, storage, record, attempt.number))
            if "wandb" in wanted:
                sinks.append(WandbSink.open(spec, storage, record, attempt.number))
        except BaseException:
            for s in sinks:
                s.end(ok=False)
            raise
    if json.dumps(record, sort_keys=True) != before and may_write():
        storage.write_json(record, TRACKING)
    return sinks
