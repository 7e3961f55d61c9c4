"""Storage someone else can write (issue #27, items 8-10 and 16): whatever is planted under the run
directory (a symbolic link out of it, a FIFO, a link to ``/dev/zero``, a manifest of a million
entries) is never written or read through, never blocks and is never read past what the file can
hold; the user sees it as a candidate's reason, and the run's own committed states keep resuming.

* writes: a planted link at ``final/model.safetensors`` (to an executable script outside), ``final/``,
  ``plot.png``, ``lease.json.lock``, the storage probe or the next state's directory is replaced
  (one WARNING line), its target untouched; ``states/`` itself as a link refuses the run;
* reads: ``manifest.json``/``trainer.json`` as a FIFO, a link to ``/dev/zero`` or a link to a copy of
  itself outside; a shard or RNG file listed with size 0 and planted as such; ``lease.json`` as
  either; an event file that is a link; object stores read with ranges bounded the same way.

Cases where the old code hung or read without end run in a forked child (:func:`bounded`) with a
deadline and capped memory and file size: a regression fails the test instead of hanging the suite
or filling the disk.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import resource
import select
import shutil
import signal
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncpoint.orchestrator.cli import main
from syncpoint.policies.contracts.errors import LeaseRefused, OversizedEntry, ResumeRefused, UnsafeEntry
from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, MANIFEST_MAX_FILES
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.state.discovery import read_candidate
from syncpoint.workers.state.reader import fetch_state
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.lease import RunLease, await_expiry, read_lease
from tests.helpers import cli, linear_spec, run, run_until_crash
from tests.s3_server import BUCKET

# 8 micro-batches, accumulation 2, a state every optimizer step: 2, 4, 6, 8.
LAYOUT = ("task.config.num_samples=8", "train.grad_accum=2", "checkpoint.save_every={value: 1, unit: optimizer_steps}")
STATES = [f"{s:012d}" for s in (2, 4, 6, 8)]
NEWEST, OLDER = STATES[-1], STATES[-2]
SHARD = "engine/mp_rank_00_model_states.pt"
RNG = "rng/rank_00000.safetensors"
SCRIPT = b"#!/bin/sh\necho attacker-was-here > /tmp/never\n"
KINDS = ("fifo", "devzero", "outside")  # a FIFO; a link to /dev/zero; a link to an outside copy of the same bytes


# ---------------------------------------------------------------- helpers


def bounded(fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
    """``fn(*args)`` in a forked child, its address space capped at 1 GiB more than now and its files at
    64 MiB, killed after ``timeout``; returns ``("ok", value)`` or ``("raised", "Type: message")``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            cap = _vm_bytes() + (1 << 30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
            try:
                out: tuple[str, Any] = ("ok", fn(*args))
            except BaseException as e:  # noqa: BLE001 - reported to the parent as data
                out = ("raised", f"{type(e).__name__}: {e}")
            with os.fdopen(w, "wb") as f:
                f.write(pickle.dumps(out))
        except BaseException:  # noqa: BLE001 - the child must exit whatever happened
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                pytest.fail(
                    f"{getattr(fn, '__name__', fn)} did not return within {timeout:.0f}s (blocked or reading "
                    "without end)"
                )
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # ours, and done or stuck: never waited for
        _, status = os.waitpid(pid, 0)
    if not chunks:
        pytest.fail(
            f"{getattr(fn, '__name__', fn)} died without an answer (status {status:#x}: out of memory or "
            "past its file size)"
        )
    return pickle.loads(b"".join(chunks))


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def snapshot(root: Path) -> dict[str, tuple[str, bytes, int]]:
    """Every entry below ``root`` as (kind, bytes, mode), links not followed: what must not change."""
    out: dict[str, tuple[str, bytes, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            st_ = p.lstat()
            kind = "link" if p.is_symlink() else "dir" if p.is_dir() else "file"
            data = p.read_bytes() if kind == "file" and stat.S_ISREG(st_.st_mode) else b""
            out[str(p.relative_to(root))] = (kind, data, stat.S_IMODE(st_.st_mode))
    return out


def plant(path: Path, kind: str, outside: Path) -> None:
    """Replace ``path`` by a FIFO, a link to /dev/zero, or a link to an outside copy of its own bytes."""
    original = path.read_bytes() if path.is_file() else b""
    if path.is_symlink() or path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    else:
        outside.mkdir(exist_ok=True)
        copy = outside / f"copy-{uuid.uuid4().hex[:8]}-{path.name}"
        copy.write_bytes(original)
        os.symlink(copy, path)


def list_as_empty(state_dir: Path, rel: str) -> None:
    """The attacker's rewrite of the manifest: ``rel`` listed with size 0 (and the empty checksum)."""
    m = json.loads((state_dir / "manifest.json").read_bytes())
    m["files"][rel] = {"size": 0, "xxh3_128": checksum_bytes(b"", "xxh3_128")}
    (state_dir / "manifest.json").write_text(json.dumps(m))


def states_json(run_dir: str) -> tuple[int, Any, str]:
    """``syncpoint states RUN --json``: (exit code, the JSON or None, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["states", run_dir, "--json"])
    return rc, json.loads(out.getvalue()) if rc == 0 else None, err.getvalue()


def digest_cli(state_dir: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["digest", state_dir])
    return rc, err.getvalue()


def verdicts(listed: dict) -> dict[str, tuple[str, str]]:
    return {c["state"]: (c["verdict"], c["reason"]) for c in listed["candidates"]}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """One finished run (states 2, 4, 6, 8), copied by each test that plants something in it."""
    spec = linear_spec(tmp_path_factory.mktemp("template"), *LAYOUT)
    run(spec)
    return Path(spec.run_url[len("file://") :])


@pytest.fixture
def copy_of(template, tmp_path):
    """A fresh copy of the template run: (its spec, its run directory)."""
    spec = linear_spec(tmp_path / "copy", *LAYOUT)
    run_dir = Path(spec.run_url[len("file://") :])
    shutil.copytree(template, run_dir, symlinks=True)
    return spec, run_dir


# ---------------------------------------------------------------- writes never follow a planted link


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "target",
    [
        "final/model.safetensors",
        "final/info.json",
        "final/spec.json",
        "final",
        "plot.png",
        "lease.json.lock",
        ".syncpoint-probe",
        f"states/{OLDER}",
        f"states/{NEWEST}",
    ],
)
def test_a_planted_link_is_replaced_and_its_target_never_written(tmp_path, capsys, target):
    from syncpoint.orchestrator.cli_jobs import _check_storage
    from syncpoint.orchestrator.run_outcome import finish_line

    spec = linear_spec(
        tmp_path / "store", *LAYOUT, "checkpoint.export_final=true", "faults=[{at_micro_step: 5, mode: raise}]"
    )
    assert run_until_crash(spec)  # states 2 and 4 committed; the planted link waits for what comes next
    run_dir = Path(spec.run_url[len("file://") :])
    outside = tmp_path / "outside"
    (outside / "victim_dir").mkdir(parents=True)
    (outside / "victim_dir" / "keep").write_bytes(b"the attacker's directory")
    victim = outside / "victim.sh"
    victim.write_bytes(SCRIPT)
    victim.chmod(0o755)
    link = run_dir / target
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_file():
        link.unlink()  # lease.json.lock: left by the first attempt
    points_to = {
        "final": outside / "victim_dir",
        f"states/{OLDER}": outside / "victim_dir",
        f"states/{NEWEST}": outside / "victim_dir",
        "lease.json.lock": outside / "created-through-the-lock",
    }
    os.symlink(points_to.get(target, victim), link)
    before = snapshot(outside)

    _check_storage(spec)
    result = run(spec)
    finish_line(spec)  # draws plot.png as the driver does

    assert snapshot(outside) == before, "a write went through the planted link"
    assert not link.is_symlink() and (link.exists() or target == ".syncpoint-probe")  # the probe is removed again
    assert f"{target} was a symbolic link; replaced" in capsys.readouterr().err
    assert result.resumed_from == STATES[1] and result.final_state == NEWEST
    rc, listed, _ = states_json(str(run_dir))
    assert rc == 0 and all(v == "resumable" for v, _ in verdicts(listed).values()), verdicts(listed)
    assert set(verdicts(listed)) == set(STATES)
    assert run(spec).resumed_from == NEWEST  # the run's own newest state resumes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_states_as_a_link_refuses_the_run_and_touches_nothing_behind_it(copy_of, tmp_path, capsys):
    spec, run_dir = copy_of
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(run_dir / "states", outside / "states")
    os.symlink(outside / "states", run_dir / "states")
    before = snapshot(outside)
    spec = linear_spec(tmp_path / "copy", *LAYOUT, "train.epochs=2", "checkpoint.keep_last=1")  # more to train

    with pytest.raises(
        ResumeRefused,
        match=r"states cannot be used: states is a symbolic link.*Replace it with a "
        r"real directory",
    ):
        run(spec)
    rc, _, err = cli(capsys, "states", str(run_dir))
    assert rc == 2 and "states is a symbolic link" in err and "Replace it with a real directory" in err
    assert snapshot(outside) == before  # nothing saved into it, nothing retention deleted from it


# ---------------------------------------------------------------- reads: only regular files, never a link, bounded


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("target", ["manifest.json", "trainer.json"])
def test_unreadable_metadata_is_the_newest_states_reason_and_selection_falls_back(copy_of, tmp_path, target, kind):
    _, run_dir = copy_of
    outside = tmp_path / "outside"
    plant(run_dir / "states" / NEWEST / target, kind, outside)
    before = snapshot(outside) if outside.exists() else {}

    status, (rc, listed, err) = bounded(states_json, str(run_dir))
    assert status == "ok" and rc == 0, err
    verdict, reason = verdicts(listed)[NEWEST]
    what = {"fifo": "is a FIFO", "devzero": "is a symbolic link", "outside": "is a symbolic link"}[kind]
    assert verdict == "corrupt" and f"{target} {what}" in reason, reason
    assert all(verdicts(listed)[s][0] == "resumable" for s in STATES[:-1])
    assert listed["choice"]["state"] == OLDER
    status, (rc, err) = bounded(digest_cli, str(run_dir / "states" / NEWEST))
    assert status == "ok" and rc == 2 and what in err, err
    assert (snapshot(outside) if outside.exists() else {}) == before


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
@pytest.mark.parametrize("rel", [SHARD, RNG])
def test_a_file_listed_with_size_zero_is_never_copied_or_read_past_it(copy_of, tmp_path, rel, kind):
    """The copying fetch (``init_from``, elastic and module-only loads), the in-place one and
    ``digest`` all stop at once: a link or FIFO is refused, never read."""
    _, run_dir = copy_of
    state = run_dir / "states" / NEWEST
    list_as_empty(state, rel)
    plant(state / rel, kind, tmp_path / "outside")

    status, (rc, listed, err) = bounded(states_json, str(run_dir))
    assert status == "ok" and rc == 0, err
    verdict, reason = verdicts(listed)[NEWEST]
    assert verdict == "corrupt" and rel in reason and ("FIFO" in reason or "symbolic link" in reason), reason
    assert listed["choice"]["state"] == OLDER
    for in_place in (False, True):
        status, error = bounded(_fetch, str(run_dir), NEWEST, in_place)
        assert status == "raised" and error.startswith("StateRefused") and rel in error, error
    status, (rc, err) = bounded(digest_cli, str(state))
    assert status == "ok" and rc == 2, err


def _fetch(run_dir: str, name: str, in_place: bool) -> str:
    store = RunStorage(run_dir)
    fetched = fetch_state(store, read_candidate(store, name), 0, in_place=in_place)
    fetched.cleanup()
    return "fetched"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_over_a_fifo_manifest_resumes_its_own_older_state(copy_of):
    spec, run_dir = copy_of
    plant(run_dir / "states" / NEWEST / "manifest.json", "fifo", run_dir)
    spec = linear_spec(run_dir.parent, *LAYOUT, "train.epochs=2")
    result = run(spec)
    assert result.resumed_from == OLDER and result.final_state == f"{16:012d}"


@pytest.mark.parametrize("kind", ["fifo", "devzero"])
def test_a_lease_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plant(run_dir / "lease.json", kind, tmp_path / "outside")
    status, out = bounded(_lease_outcomes, str(run_dir))
    assert status == "ok", out
    read, waited, acquired = out
    what = "is a FIFO" if kind == "fifo" else "is a symbolic link"
    assert read.startswith("UnsafeEntry") and what in read, read
    assert waited == "undecided"  # the driver's wait gives up at once; rank 0 names it
    assert acquired.startswith("LeaseRefused") and f"lease.json {what}" in acquired, acquired


def _lease_outcomes(run_dir: str) -> tuple[str, str, str]:
    store = RunStorage(run_dir)
    try:
        read = f"read {read_lease(store)}"
    except UnsafeEntry as e:
        read = f"UnsafeEntry: {e}"
    waited = await_expiry(store, "job", own_ttl_s=60.0, poll_s=0.01, say=lambda _: None)
    try:
        RunLease(store, job_identity="job", job_name="j", submission="s", ttl_s=5).acquire()
        acquired = "acquired"
    except LeaseRefused as e:
        acquired = f"LeaseRefused: {e}"
    return read, waited, acquired


def test_a_lock_file_planted_as_a_link_creates_nothing_behind_it(tmp_path, capsys):
    run_dir, target = tmp_path / "run", tmp_path / "outside" / "would-be-created"
    run_dir.mkdir()
    target.parent.mkdir()
    os.symlink(target, run_dir / "lease.json.lock")
    assert read_lease(RunStorage(str(run_dir))) is None
    assert not target.exists() and not (run_dir / "lease.json.lock").is_symlink()
    assert "lease.json.lock was a symbolic link; replaced" in capsys.readouterr().err


def test_an_event_file_that_is_a_link_or_fifo_is_not_read(copy_of, tmp_path):
    _, run_dir = copy_of
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"kind": "finished", "time": 1.0, "source": "attacker", "marker": "outside"}))
    os.symlink(outside, run_dir / "events" / "00000000000000000001-finished-linked.json")
    os.mkfifo(run_dir / "events" / "00000000000000000002-finished-fifo.json")

    def events() -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = main(["events", str(run_dir), "--json"])
        return rc, out.getvalue()

    status, (rc, out) = bounded(events)
    assert status == "ok" and rc == 0 and json.loads(out) and "attacker" not in out


@pytest.mark.parametrize("entries", [1_000_000, MANIFEST_MAX_FILES + 50_000])
def test_a_manifest_of_too_many_entries_is_refused_quickly(copy_of, entries):
    """10^6 entries (70 MB: past the byte cap) and 150,000 compact ones (under it: the entry cap)."""
    _, run_dir = copy_of
    digest = checksum_bytes(b"", "xxh3_128")
    with open(run_dir / "states" / NEWEST / "manifest.json", "w") as f:
        f.write('{"files": {')
        f.write(",".join(f'"e/{i}": {{"size": 0, "xxh3_128": "{digest}"}}' for i in range(entries)))
        f.write("}}")
    started = time.monotonic()
    status, (rc, listed, err) = bounded(states_json, str(run_dir))
    assert status == "ok" and rc == 0, err
    assert time.monotonic() - started < 20  # 28 s before any bound
    verdict, reason = verdicts(listed)[NEWEST]
    why = (
        f"more than the {MANIFEST_MAX_BYTES} it can hold"
        if entries == 1_000_000
        else f"more than the {MANIFEST_MAX_FILES} a state holds"
    )
    assert verdict == "corrupt" and why in reason, reason
    assert listed["choice"]["state"] == OLDER


# ---------------------------------------------------------------- the property: any plants, anywhere


PLANT = st.tuples(
    st.sampled_from(range(len(STATES))),
    st.sampled_from(["manifest.json", "trainer.json", SHARD, RNG]),
    st.sampled_from(KINDS),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plants=st.lists(PLANT, min_size=1, max_size=4))
def test_any_plants_leave_every_clean_state_resumable_and_nothing_outside_touched(template, tmp_path, plants):
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    outside = tmp_path / f"outside-{run_dir.name}"
    shutil.copytree(template, run_dir, symlinks=True)
    planted = set()
    for i, rel, kind in plants:
        state = run_dir / "states" / STATES[i]
        if (i, rel) in {(j, r) for j, r, _ in planted}:
            continue
        if rel in (SHARD, RNG) and (i, "manifest.json") not in {(j, r) for j, r, _ in planted}:
            list_as_empty(state, rel)  # the attack that the listing's size cannot catch
        plant(state / rel, kind, outside)
        planted.add((i, rel, kind))
    before = snapshot(outside) if outside.exists() else {}

    status, (rc, listed, err) = bounded(states_json, str(run_dir))
    assert status == "ok" and rc == 0, err
    dirty = {STATES[i] for i, _, _ in planted}
    for name, (verdict, reason) in verdicts(listed).items():
        assert (verdict == "resumable") == (name not in dirty), (name, verdict, reason)
    clean = [s for s in STATES if s not in dirty]
    assert listed["choice"].get("state") == (clean[-1] if clean else None)
    assert (snapshot(outside) if outside.exists() else {}) == before


# ---------------------------------------------------------------- object stores: ranged, bounded reads


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_object_store_reads_stop_at_their_bound(request, tmp_path, where):
    if where == "s3":
        request.getfixturevalue("s3")
        store = RunStorage(f"s3://{BUCKET}/hostile-{uuid.uuid4().hex[:8]}")
    else:
        store = RunStorage(f"memory://hostile-{uuid.uuid4().hex[:8]}")
    data = os.urandom(3 << 20)
    store.write_bytes(data, "big.bin")
    store.write_bytes(b"", "empty.bin")
    with pytest.raises(OversizedEntry):
        store.read_bytes("big.bin", limit=10)
    with pytest.raises(OversizedEntry):
        store.download_file(str(tmp_path / "copy.bin"), "big.bin", limit=10)
    with pytest.raises(OversizedEntry):
        store.read_versioned("big.bin", limit=10)
    assert store.read_bytes("big.bin", limit=len(data)) == data
    assert store.download_file(str(tmp_path / "copy.bin"), "big.bin", limit=len(data)) == (
        len(data),
        checksum_bytes(data, "xxh3_128"),
    )
    assert store.read_bytes("empty.bin", limit=0) == b""
    got = store.read_versioned("empty.bin", limit=0)
    assert got is not None and got.data == b""


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_a_range_reads_only_its_bytes_and_refuses_what_its_bound_or_length_rules_out(request, tmp_path, where):
    """A node's ranks download a shared file's ranges side by side (``node_share``): each range is
    exactly its bytes, at the offset asked, several fill one file, and a stored file larger than its
    bound or shorter than the range is refused before anything past it is read."""
    if where == "s3":
        request.getfixturevalue("s3")
        store = RunStorage(f"s3://{BUCKET}/ranges-{uuid.uuid4().hex[:8]}")
    elif where == "memory":
        store = RunStorage(f"memory://ranges-{uuid.uuid4().hex[:8]}")
    else:
        store = RunStorage(str(tmp_path / "run"))
    data = os.urandom(3 << 20)
    store.write_bytes(data, "big.bin")
    piece = tmp_path / "piece.bin"
    store.download_range(str(piece), "big.bin", start=1000, end=2_000_000, limit=len(data))
    assert piece.read_bytes() == data[1000:2_000_000]
    whole = tmp_path / "whole.bin"
    for start, end in ((2_000_000, len(data)), (0, 2_000_000)):  # any order, each at its own offset
        store.download_range(str(whole), "big.bin", start=start, end=end, limit=len(data), at=start)
    assert whole.read_bytes() == data
    with pytest.raises(OversizedEntry):
        store.download_range(str(tmp_path / "x.bin"), "big.bin", start=0, end=10, limit=len(data) - 1)
    with pytest.raises(UnsafeEntry, match="shorter"):
        store.download_range(
            str(tmp_path / "x.bin"), "big.bin", start=len(data) - 10, end=len(data) + 10, limit=len(data) + 10
        )
    if where == "local":
        os.symlink(tmp_path / "whole.bin", tmp_path / "run" / "link.bin")
        with pytest.raises(UnsafeEntry):
            store.download_range(str(tmp_path / "y.bin"), "link.bin", start=0, end=10, limit=len(data))
