"""A save's staging directory (``syncpoint.workers.state.staging``): its name says whose it is, and an
attempt removes what a killed rank of this user left on the node, nothing else."""

from __future__ import annotations

import os
import subprocess

import pytest

from syncpoint.workers.state.staging import STAGING, _owner, staging_prefix, sweep_stale_staging


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_dead_ranks_staging_goes_and_everything_else_stays(tmp_path):
    namespace, me = _owner().split(".")
    dead = _dead_pid()
    stale = tmp_path / f"{STAGING}{namespace}.{dead}-abc"
    (stale / "optim").mkdir(parents=True)
    (stale / "optim" / "full.safetensors").write_bytes(b"x" * 4096)
    live = tmp_path / f"{STAGING}{namespace}.{me}-def"
    live.mkdir()
    elsewhere = tmp_path / f"{STAGING}1.{dead}-ghi"  # another pid namespace: its pids are not ours to judge
    elsewhere.mkdir()
    older = tmp_path / f"{STAGING}k2x9q"  # an older syncpoint's name, without an owner
    older.mkdir()
    target = tmp_path / "outside"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / f"{STAGING}{namespace}.{dead}-lnk"
    link.symlink_to(target)
    plain = tmp_path / f"{STAGING}{namespace}.{dead}-file"
    plain.write_text("not a directory")

    assert sweep_stale_staging(str(tmp_path)) == [stale.name]
    assert not stale.exists()
    for kept in (live, elsewhere, older, link, plain):
        assert os.path.lexists(kept), kept
    assert (target / "keep.txt").read_text() == "mine"  # never entered through the link


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory to another account")
def test_another_accounts_staging_is_never_removed(tmp_path):
    namespace, _ = _owner().split(".")
    theirs = tmp_path / f"{STAGING}{namespace}.{_dead_pid()}-xyz"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    assert sweep_stale_staging(str(tmp_path)) == []
    assert theirs.is_dir()


def test_a_saves_staging_name_carries_its_process():
    namespace = os.stat("/proc/self/ns/pid").st_ino
    assert staging_prefix() == f"{STAGING}{namespace}.{os.getpid()}-"


def test_a_run_sweeps_a_killed_ranks_staging_and_leaves_none_of_its_own(tmp_path, monkeypatch):
    """What a rank killed in an async save leaves (here planted) is gone once the next attempt's writer
    starts; the run's own staging directories are gone when it ends."""
    from tests.helpers import lm_spec, run

    root = tmp_path / "staging"
    root.mkdir()
    monkeypatch.setenv("SYNCPOINT_STAGING_DIR", str(root))
    namespace, _ = _owner().split(".")
    stale = root / f"{STAGING}{namespace}.{_dead_pid()}-old"
    (stale / "optim").mkdir(parents=True)
    spec = lm_spec(
        tmp_path / "run",
        "task.config.num_samples=16",
        "train.grad_accum=2",
        "train.epochs=1",
        "checkpoint.save_every={value: 2, unit: micro_steps}",
        "checkpoint.async=true",
    )
    run(spec)
    assert os.listdir(root) == []
