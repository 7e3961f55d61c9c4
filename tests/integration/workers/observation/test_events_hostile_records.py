"""Hostile records and arguments (issue 27, items 10, 13, 14, 15): what storage holds or a command
line says never fails a run, never becomes a traceback, an unbounded allocation or a hang.

* Event files planted among a run's events (10⁵-deep JSON, a 400-digit time, a time "NaN", a list,
  an oversized file) are skipped and named: the run goes on, ``syncpoint events`` says so in one line.
* State files built to cost memory or crash a reader (a stride-0 view of 3·10⁹ elements, a meta
  tensor of 10¹², ``bytearray(10**13)``, ``torch.FloatTensor(10**5, 10**5)``, deep, cyclic and
  exponentially shared structures, a bad safetensors header, deep JSON) make ``syncpoint digest``
  exit 2 with one paragraph, and a resume falls back past them. Those run in a subprocess under an
  address-space limit (and a per-case alarm), so a regression fails fast instead of swapping.
* ``--policy os:system`` is refused before anything calls it; the CLI's other failure modes (a file
  or an unreachable URL as RUN_DIR, deep ``--policy-args``, an odd ``--plot`` path, a closed
  stdout) are one paragraph or a quiet exit; a FIFO as the job file is refused, never waited on.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from syncpoint.policies.contracts.errors import JobConfigError, StateRefused, TaskError
from syncpoint.policies.contracts.journal import Journal, UnknownEvent
from syncpoint.workers.integrity.checksum import checksum_bytes, entry
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import cli, committed_steps, linear_spec, run, run_until_crash

ROOT = Path(__file__).resolve().parents[4]
NEWEST, OLDER = f"{8:012d}", f"{4:012d}"
MODEL = "engine/mp_rank_00_model_states.pt"  # ZeRO 0: module and optimizer in one file
RNG = "rng/rank_00000.safetensors"


def _local(url: str) -> str:
    return url[len("file://") :]


def assert_one_paragraph(err: str) -> None:
    assert err.strip() and "Traceback" not in err and "\n\n" not in err.strip(), err
    assert len(err.encode()) < 2048, err[:300]


# ----------------------------------------------------------------------------- 13: planted event files


def _plant_events(store: RunStorage) -> dict[str, str]:
    """Files a storage writer plants among the events, each with what the reader says of it."""
    planted = {
        "00000000000000000001-deep-x.json": ("[" * 100_000 + "]" * 100_000, "nested deeper than 16 levels"),
        "00000000000000000002-bigtime-x.json": ('{"kind": "progress", "time": ' + "9" * 400 + "}", "an integer of 400"),
        "00000000000000000003-nantime-x.json": ('{"kind": "progress", "time": "NaN"}', "time is not a usable"),
        "00000000000000000004-list-x.json": ("[1, 2, 3]", "not a JSON object"),
        "00000000000000000005-huge-x.json": ('{"kind": "x", "pad": "' + "x" * (1 << 20) + '"}', "larger than"),
        "00000000000000000006-inftime-x.json": ('{"kind": "finished", "time": 1e400}', "time is not a usable"),
    }
    for name, (text, _) in planted.items():
        store.write_bytes(text.encode(), "events", name)
    return {name: why for name, (_, why) in planted.items()}


def test_planted_event_files_are_skipped_and_named_and_the_run_goes_on(tmp_path, capsys):
    spec = linear_spec(tmp_path, "task.config.num_samples=8")
    store = RunStorage(spec.run_url)
    planted = _plant_events(store)
    result = run(spec)  # every attempt reads the log at its start
    assert result.optimizer_step == 2 and committed_steps(spec) == [8]
    assert "[syncpoint] 6 event record(s) unreadable, skipped: " in capsys.readouterr().err  # rank 0 says so
    journal = EventLog(store).journal()
    assert sorted(s.split(" ")[0] for s in journal.skipped) == sorted(planted)
    for name, why in planted.items():
        assert any(s.startswith(name) and why in s for s in journal.skipped), (name, journal.skipped)
    assert journal.last_finish is not None and journal.unknown == []

    rc, out, err = cli(capsys, "events", _local(spec.run_url))
    assert rc == 0, err
    first, *rest = out.splitlines()
    assert first.startswith("6 event record(s) unreadable, skipped: 00000000000000000001-deep-x.json (nested deeper")
    assert first.endswith(" and 1 more") and len(first) < 1000
    assert any("finished" in line for line in rest) and any(line.startswith("goodput") for line in rest)

    rc, out, err = cli(capsys, "events", "--json", _local(spec.run_url))
    assert rc == 0 and err.startswith("6 event record(s) unreadable, skipped:")
    assert [r["kind"] for r in json.loads(out)][-1] == "finished"  # stdout: only the records as stored


def test_progress_batches_stay_within_what_the_reader_accepts():
    """Thousands of steps with train.record_samples inside one flush interval: the writer flushes by
    size too, so no progress event is ever a file the reader skips as too large."""
    from syncpoint.workers.observation.events import EVENT_MAX_BYTES
    from syncpoint.workers.observation.progress import ProgressLog

    store = RunStorage(f"memory://progress-{os.getpid()}-{id(object())}")
    log = ProgressLog(EventLog(store), attempt=1)
    for step in range(1, 2001):
        log.add(
            {
                "optimizer_step": step,
                "global_micro_step": step,
                "epoch": 0,
                "loss": 0.1,
                "lr": 0.01,
                "time": 1e9 + step,
                "samples": list(range(10**9, 10**9 + 100)),
            }
        )
    log.flush()
    sizes = [len(store.read_bytes("events", n, limit=1 << 30)) for n in store.list_files("events")]
    assert len(sizes) > 1 and max(sizes) <= EVENT_MAX_BYTES, sizes
    journal = EventLog(store).journal()
    assert journal.skipped == [] and sorted(journal.steps()) == list(range(1, 2001))


def test_numbers_no_arithmetic_takes_are_skipped_or_kept_as_unknown_never_raised():
    """What the reader is handed directly (``Journal.parse`` of ``syncpoint events --json`` records):
    a 400-digit or non-finite time is skipped and named; a 400-digit number inside a known event is
    an unknown event; sorting, the timeline and goodput all go on."""
    from syncpoint.orchestrator.timeline import format_timeline
    from syncpoint.policies.decisions.goodput import goodput

    good = [
        {"kind": "submitted", "time": 1.0, "source": "driver", "name": "j", "address": "embedded"},
        {
            "kind": "finished",
            "time": 5.0,
            "source": "worker",
            "attempt": 1,
            "state": None,
            "global_micro_step": 4,
            "optimizer_step": 1,
        },
    ]
    bad = [
        {"kind": "progress", "time": 10**400},
        {"kind": "progress", "time": math.nan},
        {"kind": "progress", "time": "NaN"},
        {"kind": "progress", "time": [1]},
        {
            "kind": "progress",
            "time": 2.0,
            "attempt": 1,
            "records": [
                {"optimizer_step": 1, "global_micro_step": 4, "epoch": 0, "loss": 1.0, "lr": 0.1, "time": 10**400}
            ],
        },
    ]
    journal = Journal.parse(bad + good)
    assert len(journal.skipped) == 4 and all("time is not a usable number" in s for s in journal.skipped)
    (unknown,) = journal.unknown
    assert isinstance(unknown, UnknownEvent) and unknown.time == 2.0 and "records.0.time" in unknown.problem
    assert [e.kind for e in journal.events] == ["submitted", "progress", "finished"]
    assert "finished" in format_timeline(journal)
    goodput(journal)  # no attempt: no goodput, and no OverflowError on the way


# ----------------------------------------------------------------------------- 14: hostile state files


def _torch_file(pickle_bytes: bytes) -> bytes:
    """A zip-format torch file whose data.pkl is the given (hand-written) pickle."""
    buf = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buf)
    for name, data in (("data.pkl", pickle_bytes), (".format_version", b"1"), ("byteorder", b"little")):
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return buf.getvalue()


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _long1(n: int) -> bytes:
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _with_param(store: RunStorage, tensor: torch.Tensor) -> bytes:
    """The state's own model file with its first parameter replaced."""
    from syncpoint.workers.integrity.safe_load import load_state_file

    sd = load_state_file(store.read_bytes("states", NEWEST, MODEL, limit=1 << 30), MODEL)
    sd["module"][next(iter(sd["module"]))] = tensor
    return _saved(sd)


def _shared_dag(levels: int) -> bytes:
    """L0 = []; L(i) = [L(i-1), L(i-1)]: a few bytes per level, 2**levels members when walked."""
    out = b"\x80\x02]r" + struct.pack("<I", 0)
    for i in range(1, levels):
        get = b"j" + struct.pack("<I", i - 1)
        out += b"](" + get + get + b"er" + struct.pack("<I", i)
    return out + b"."


def _deep_json(depth: int) -> bytes:
    return ("[" * depth + "]" * depth).encode()


# name -> (file, how to build it from the state's storage, what the refusal says)
STATE_CASES = {
    "stride-0-view": (MODEL, lambda s: _with_param(s, torch.zeros(1).expand(3 * 10**9)), "expanded or overlapping"),
    "meta-tensor": (MODEL, lambda s: _with_param(s, torch.empty(10**12, device="meta")), "_rebuild_meta_tensor"),
    "bytearray": (
        MODEL,
        lambda s: _torch_file(b"\x80\x02cbuiltins\nbytearray\n" + _long1(10**13) + b"\x85R."),
        "calls builtins.bytearray",
    ),
    "tensor-constructor": (
        MODEL,
        lambda s: _torch_file(b"\x80\x02ctorch\nFloatTensor\n" + _long1(10**5) * 2 + b"\x86R."),
        "calls torch.FloatTensor",
    ),
    "hex-doubling": (
        MODEL,
        lambda s: _torch_file(
            b"\x80\x02c_codecs\nencode\nq\x00"
            + b"h\x00" * 34
            + b"h\x00X\x01\x00\x00\x00aX\x06\x00\x00\x00latin1\x86R"
            + b"X\x03\x00\x00\x00hex\x86R" * 34
            + b"."
        ),
        "calls _codecs.encode",
    ),
    "deep-nesting": (
        MODEL,
        lambda s: _torch_file(b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."),
        "nests deeper than 100",
    ),
    "cycle": (MODEL, lambda s: _torch_file(b"\x80\x02]q\x00h\x00a."), "contains itself"),
    "shared-2-to-the-100": (MODEL, lambda s: _torch_file(_shared_dag(100)), "expands to more than"),
    "safetensors-header-length": (
        RNG,
        lambda s: struct.pack("<Q", 2**63) + s.read_bytes("states", NEWEST, RNG, limit=1 << 30)[8:],
        "safetensors",
    ),
    "trainer-json-deep": ("trainer.json", lambda s: _deep_json(100_000), "trainer.json is JSON nested deeper"),
}


def _plant(store: RunStorage, rel: str, data: bytes) -> None:
    """Replace one file of the newest state and re-commit its manifest to match (a storage writer)."""
    store.write_bytes(data, "states", NEWEST, rel)
    manifest = json.loads(store.read_bytes("states", NEWEST, "manifest.json", limit=1 << 30))
    manifest["files"][rel] = entry(len(data), "xxh3_128", checksum_bytes(data, "xxh3_128")).record()
    store.commit_bytes(json.dumps(manifest).encode(), "states", NEWEST, "manifest.json")


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """A linear run (ZeRO 0) with states at micro-steps 4 and 8, crashed after 8."""
    spec = linear_spec(
        tmp_path_factory.mktemp("crashed"),
        "task.config.num_samples=16",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 10, mode: raise}]",
    )
    assert run_until_crash(spec) and committed_steps(spec) == [4, 8]
    return spec


def _hostile_copies(crashed, root: Path, cases: list[str]) -> dict[str, str]:
    """case -> storage URL of a copy of the crashed run whose newest state holds that case's file."""
    urls = {}
    for case in cases:
        target = root / case
        shutil.copytree(Path(crashed.storage[len("file://") :]), target)
        url = f"file://{target}/{crashed.name}"
        rel, build, _ = STATE_CASES.get(case, (None, None, None))
        store = RunStorage(url)
        if case == "manifest-json-deep":
            store.commit_bytes(_deep_json(100_000), "states", NEWEST, "manifest.json")
        else:
            _plant(store, rel, build(store))
        urls[case] = url
    return urls


# Runs each job in one fresh interpreter under a 4 GiB address-space limit, each with an alarm: an
# allocation the bounds should have refused fails there (MemoryError) instead of swapping, a hang is an
# alarm; the test process itself never unpickles a hostile file. The imports come before any alarm, and
# the alarm is generous: it tells a hang from an answer, not a slow machine from a fast one.
_DRIVER = r"""
import contextlib, io, json, resource, signal, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
ALARM_S = 300
def alarm(*_):
    raise TimeoutError(f"no answer within {ALARM_S} s")
signal.signal(signal.SIGALRM, alarm)
from syncpoint.orchestrator.cli import main
import syncpoint.workers.training.loop, tests.helpers  # torch and DeepSpeed, outside every case's alarm
results = {}
for case, job in json.loads(sys.stdin.read()).items():
    err, out = io.StringIO(), io.StringIO()
    signal.alarm(ALARM_S)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            if job["kind"] == "digest":
                rc = main(["digest", job["state"]])
            else:
                from syncpoint.policies.contracts.spec import JobSpec
                from tests.helpers import run
                from syncpoint.workers.observation.events import EventLog
                from syncpoint.workers.storage import RunStorage
                spec = JobSpec.model_validate_json(job["spec"])
                rc = run(spec).resumed_from
                decision = [e for e in EventLog(RunStorage(spec.run_url)).read_all()
                            if e["kind"] == "resume_decision"][-1]
                err.write(json.dumps({c["state"]: c["reason"] for c in decision["candidates"]}))
    except BaseException as e:
        rc = f"raised {type(e).__name__}: {str(e)[:200]}"
    finally:
        signal.alarm(0)
    results[case] = {"rc": rc, "err": err.getvalue()}
print("RESULTS " + json.dumps(results))
"""


def _drive(jobs: dict[str, dict]) -> dict[str, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULTS ")), None)
    assert line is not None, (proc.returncode, proc.stderr[-3000:])
    return json.loads(line[len("RESULTS ") :])


@pytest.fixture(scope="module")
def digests(crashed, tmp_path_factory):
    cases = [*STATE_CASES, "manifest-json-deep"]
    urls = _hostile_copies(crashed, tmp_path_factory.mktemp("hostile"), cases)
    return _drive({case: {"kind": "digest", "state": f"{_local(url)}/states/{NEWEST}"} for case, url in urls.items()})


@pytest.mark.parametrize("case", [*STATE_CASES, "manifest-json-deep"])
def test_digest_refuses_a_hostile_state_in_one_paragraph(digests, case):
    """Exit 2, one paragraph naming the file and why, no traceback, no allocation beyond the bounds."""
    result = digests[case]
    assert result["rc"] == 2, result
    err = result["err"]
    assert_one_paragraph(err)
    why = STATE_CASES[case][2] if case in STATE_CASES else "manifest.json is JSON nested deeper"
    assert why in err and "refused" in err, err


def test_digest_of_the_untouched_state_still_works(crashed, capsys):
    """Guards the cases above: the same state, unplanted, digests (exit 0, a sha256)."""
    rc, out, err = cli(capsys, "digest", f"{_local(crashed.run_url)}/states/{NEWEST}")
    assert rc == 0 and len(out.strip()) == 64, err


RESUME_CASES = ["stride-0-view", "bytearray", "tensor-constructor", "deep-nesting", "shared-2-to-the-100"]


@pytest.mark.slow
def test_resume_falls_back_past_a_hostile_state_file(crashed, tmp_path):
    """The same bounds hold for loading: the newest state's file is refused (a reason naming what it
    is) and the run resumes from the older state, within the address-space limit."""
    urls = _hostile_copies(crashed, tmp_path, RESUME_CASES)
    jobs = {}
    for case, url in urls.items():
        spec = crashed.model_copy(update={"storage": url.rsplit("/", 1)[0], "faults": []})
        jobs[case] = {"kind": "resume", "spec": spec.model_dump_json()}
    results = _drive(jobs)
    for case in RESUME_CASES:
        result = results[case]
        assert result["rc"] == OLDER, (case, result)
        reason = json.loads(result["err"].splitlines()[-1])[NEWEST]
        assert STATE_CASES[case][2] in reason and "refused (corrupt)" in reason, (case, reason)


def test_the_loader_refuses_what_it_would_otherwise_build(tmp_path):
    """``load_state_file`` directly (what resume, init_from and digest call), on the cases that need
    no state around them: every one is ``StateRefused`` with one line, in this process, cheaply."""
    from syncpoint.workers.integrity.safe_load import check_state_file, load_state_file

    for case in ("meta-tensor", "cycle", "deep-nesting", "shared-2-to-the-100"):
        _, build, why = STATE_CASES[case]
        data = _saved({"module": {"w": torch.empty(10**12, device="meta")}}) if case == "meta-tensor" else build(None)
        path = tmp_path / f"{case}.pt"
        path.write_bytes(data)
        for source in (data, str(path)):  # bytes (digest, a downloaded copy), a mapped path (the fetch check)
            with pytest.raises(StateRefused, match="refused") as e:
                load_state_file(source, "x.pt") if isinstance(source, bytes) else check_state_file(source, "x.pt")
            assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
    legacy = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, legacy, _use_new_zipfile_serialization=False)
    declared = legacy.getvalue().replace(b"cpuq\x06K\x04N", b"cpuq\x06J\x00\xca\x9a\x3bN")  # numel 4 -> 10**9
    with pytest.raises(StateRefused, match="declares 4000000000 bytes of tensor storage in a file of"):
        load_state_file(declared, "x.pt")  # the legacy loader allocates a storage at its declared size first
    fine = {"module": {"w": torch.arange(6.0).view(2, 3), "tied": None}, "optimizer": [1, 2.5, "x", None]}
    fine["module"]["tied"] = fine["module"]["w"]  # a tensor reached twice (tied weights) is fine
    loaded = load_state_file(_saved(fine), "fine.pt")
    assert torch.equal(loaded["module"]["tied"], torch.arange(6.0).view(2, 3))


def test_a_bad_safetensors_header_is_a_refusal():
    from syncpoint.workers.training.rng import capture, safetensors_metadata

    good = capture()
    assert "rng" in safetensors_metadata(good)
    deep = _deep_json(100_000)
    for data in (
        b"",
        b"\x01",
        struct.pack("<Q", 2**63) + good[8:],
        struct.pack("<Q", len(deep)) + deep,
        struct.pack("<Q", 5) + b"[1,2]",
        good[:8] + b"[" + good[9:],
    ):
        with pytest.raises(StateRefused, match="safetensors header.*refused"):
            safetensors_metadata(data)


# ----------------------------------------------------------------------------- 15: import paths and the CLI


@pytest.mark.parametrize(
    "path,args",
    [
        ("os:system", {"command": "touch {marker}"}),
        ("subprocess:run", {"args": ["touch", "{marker}"]}),
        ("builtins:exec", {}),
    ],
)
def test_states_never_calls_an_import_path_that_is_not_a_policy_class(crashed, tmp_path, capsys, path, args):
    marker = tmp_path / "pwned"
    policy_args = json.dumps(args).replace("{marker}", str(marker))
    rc, _, err = cli(capsys, "states", _local(crashed.run_url), "--policy", path, "--policy-args", policy_args)
    assert rc == 2 and "not a class with a choose() method; it is not called" in err, err
    assert_one_paragraph(err)
    assert not marker.exists()


def test_every_user_import_path_is_checked_before_it_is_called(tmp_path):
    """Policies, save triggers, tasks and schedules: the object a path names must be of the kind its
    role calls (a class with the role's method, a Python function), or it is never called."""
    from syncpoint.policies.contracts.import_path import load_class
    from syncpoint.policies.contracts.spec import SchedulerSpec
    from syncpoint.policies.decisions.resume import make_policy
    from syncpoint.workers.task import load_task
    from syncpoint.workers.training.schedule import Schedule

    marker = tmp_path / "pwned"
    with pytest.raises(ValueError, match="'os:system' is a builtin function, not a class with a choose"):
        make_policy("os:system", {"command": f"touch {marker}"})
    with pytest.raises(ValueError, match="'subprocess:Popen' is the class Popen, not a class with a wants_save"):
        load_class("subprocess:Popen", "wants_save")  # checkpoint.save_trigger
    with pytest.raises(TaskError, match="task.path: 'subprocess:Popen' is the class Popen, not a function"):
        load_task("subprocess:Popen", {"touch": 1, str(marker): 2})  # Popen(dict) would run its keys
    with pytest.raises(JobConfigError, match="train.scheduler.path: 'os:kill' is a builtin function"):
        Schedule(SchedulerSpec(type="custom", path="os:kill"))  # os.kill(position, total)
    assert not marker.exists()
    assert make_policy("tests.tasks:LastStateOnly", {"name": "x"}).name == "x"  # a real policy class is built


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["states", "events", "digest"])
@pytest.mark.parametrize("target", ["a-file", "unreachable-s3"])
def test_a_run_directory_that_is_not_one_is_one_paragraph(tmp_path, capsys, monkeypatch, command, target):
    if target == "a-file":
        arg = tmp_path / "plain.txt"
        arg.write_text("not a run")
        arg, why = str(arg), "not a directory, so not a"
    else:
        import fsspec.config

        # an endpoint nothing listens on (fsspec read its FSSPEC_S3_* variables at import: set its config)
        monkeypatch.setitem(
            fsspec.config.conf,
            "s3",
            {
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_closed_port()}"},
                "key": "key",
                "secret": "secret",
                "skip_instance_cache": True,
            },
        )
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
        arg, why = "s3://no-bucket/run" + ("/states/000000000008" if command == "digest" else ""), "cannot be read"
    rc, out, err = cli(capsys, command, arg)
    assert rc == 2 and why in err, err
    assert_one_paragraph(err)


def test_deep_policy_args_are_one_paragraph(crashed, capsys):
    rc, _, err = cli(capsys, "states", _local(crashed.run_url), "--policy-args", "[" * 5000 + "]" * 5000)
    assert rc == 2 and "--policy-args" in err and "nested deeper than 8 levels" in err, err
    assert_one_paragraph(err)


@pytest.mark.parametrize(
    "where,why",
    [("missing/run.png", "not an existing directory"), (".", "is a directory"), ("run.exe", "has the extension 'exe'")],
)
def test_an_odd_plot_path_is_one_paragraph(crashed, tmp_path, capsys, where, why):
    rc, _, err = cli(capsys, "events", _local(crashed.run_url), "--plot", str(tmp_path / where))
    assert rc == 2 and "--plot" in err and why in err, err
    assert_one_paragraph(err)


def test_events_into_a_closed_pipe_ends_quietly(crashed):
    """``syncpoint events --json | head -1``: the reader goes away; the command ends like a Unix tool
    killed by SIGPIPE (141), with nothing on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "syncpoint", "events", "--json", _local(crashed.run_url)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    proc.stdout.close()  # before the command writes anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b"", err.decode()[-2000:]


@pytest.mark.parametrize(
    "argv", [["validate"], ["run"], ["drill", "--preempt-at", "3"], ["submit", "--address", "http://127.0.0.1:9"]]
)
def test_a_fifo_as_the_job_file_is_refused_not_waited_on(tmp_path, argv):
    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)
    command, *rest = argv
    proc = subprocess.run(
        [sys.executable, "-m", "syncpoint", command, str(fifo), *rest],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2 and "not a regular file" in proc.stderr and str(fifo) in proc.stderr, proc.stderr
    assert_one_paragraph(proc.stderr)
