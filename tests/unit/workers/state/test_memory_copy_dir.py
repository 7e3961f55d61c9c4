"""``syncpoint.workers.state.memory_copy``'s directory rules: one private directory per user, one per run
beneath it; a node keeps the newest committed state (and newer saves in progress); removal touches
only its own run; planted links are replaced, never written through; when a copy is made at all."""

from __future__ import annotations

import os

import pytest

from syncpoint.workers.state.memory_copy import MEMORY_DIR_ENV, MemoryCopy, memory_copy_for, remove_for
from syncpoint.workers.storage import RunStorage


def _state(n: int) -> str:
    return f"{n:012d}"


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv(MEMORY_DIR_ENV, str(tmp_path))
    return tmp_path


def test_a_node_keeps_the_newest_committed_state_and_newer_saves(base):
    copy = MemoryCopy(str(base), "s3://bucket/run")
    for n in (4, 8, 10, 14):
        copy.write_bytes(_state(n), "engine/a.pt", b"x" * n)
    copy.keep_only(_state(10))  # 14: a save in progress, kept
    root = base / f"syncpoint-memory-{os.getuid()}"
    (run,) = os.listdir(root)
    assert sorted(os.listdir(root / run)) == [_state(10), _state(14)]
    assert (root / run / _state(10) / "engine" / "a.pt").read_bytes() == b"x" * 10
    assert oct((root).stat().st_mode & 0o777) == "0o700"


def test_removal_touches_only_its_own_run(base):
    a, b = MemoryCopy(str(base), "s3://bucket/a"), MemoryCopy(str(base), "s3://bucket/b")
    a.write_bytes(_state(2), "trainer.json", b"{}")
    b.write_bytes(_state(2), "trainer.json", b"{}")
    remove_for("s3://bucket/a")
    assert a.open_state(_state(2)) is None
    fd = b.open_state(_state(2))
    assert fd is not None
    os.close(fd)


def test_a_planted_link_where_a_file_goes_is_replaced_never_written_through(base, tmp_path_factory):
    copy = MemoryCopy(str(base), "s3://bucket/run")
    copy.write_bytes(_state(2), "rng/r.safetensors", b"first")
    target = tmp_path_factory.mktemp("victim") / "file"
    target.write_bytes(b"precious")
    path = base / f"syncpoint-memory-{os.getuid()}" / os.listdir(base / f"syncpoint-memory-{os.getuid()}")[0]
    leaf = path / _state(2) / "rng" / "r.safetensors"
    leaf.unlink()
    os.symlink(target, leaf)
    copy.write_bytes(_state(2), "rng/r.safetensors", b"second")
    assert target.read_bytes() == b"precious" and not leaf.is_symlink() and leaf.read_bytes() == b"second"


def test_a_state_name_must_be_one(base):
    copy = MemoryCopy(str(base), "s3://bucket/run")
    with pytest.raises(ValueError):
        copy.write_bytes("../../etc", "x", b"")


def _storage(kind: str, tmp_path) -> RunStorage:
    return RunStorage({"s3": "s3://bucket/run", "local": f"file://{tmp_path}/run", "memory": "memory://mc/run"}[kind])


@pytest.mark.parametrize(
    "setting,kind,made",
    [
        (False, "s3", False),
        ("auto", "local", False),
        ("auto", "memory", False),
        ("auto", "s3", True),
        (True, "local", True),
        (True, "s3", True),
    ],
)
def test_when_a_copy_is_made(base, tmp_path, setting, kind, made):
    assert (memory_copy_for(setting, _storage(kind, tmp_path)) is not None) == made


def test_no_shared_memory_directory_means_no_copy(monkeypatch, tmp_path):
    monkeypatch.setenv(MEMORY_DIR_ENV, str(tmp_path / "absent"))
    assert memory_copy_for(True, _storage("s3", tmp_path)) is None
    remove_for("s3://bucket/run")  # nothing to remove: no error


@pytest.mark.parametrize("how", ["another owner", "open to others"])
def test_removal_never_enters_a_directory_that_is_not_this_users_private_one(base, capsys, how):
    copy = MemoryCopy(str(base), "s3://bucket/run")
    copy.write_bytes(_state(2), "trainer.json", b"{}")
    user_dir = base / f"syncpoint-memory-{os.getuid()}"
    if how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another owner needs root")
        for d, _, files in os.walk(user_dir):
            for path in [d, *(os.path.join(d, f) for f in files)]:
                os.chown(path, os.getuid() + 4242, os.getgid() + 4242)  # whoever made it first on a shared node
    else:
        os.chmod(user_dir, 0o777)
    before = sorted(os.path.relpath(os.path.join(d, f), user_dir) for d, _, fs in os.walk(user_dir) for f in fs)
    remove_for("s3://bucket/run")  # the driver or the reaper, when the run ends
    after = sorted(os.path.relpath(os.path.join(d, f), user_dir) for d, _, fs in os.walk(user_dir) for f in fs)
    assert before == after and len(after) == 1
    assert "not this user's private directory" in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "closed"), [(0o755, True), (0o750, True), (0o775, False), (0o757, False)])
def test_an_own_directory_others_could_only_read_is_closed_one_they_could_write_is_refused(tmp_path, mode, closed):
    """An older syncpoint made its node-local directories 755: nobody else could ever write into one,
    so it is closed to 700 on its descriptor and used; one that others could write is refused."""
    from syncpoint.workers.storage.nofollow import UnsafeEntry, open_private

    (tmp_path / "cache").mkdir()
    os.chmod(tmp_path / "cache", mode)
    parent = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if closed:
            os.close(open_private(parent, "cache", "cache", create=False))
            assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
        else:
            with pytest.raises(UnsafeEntry, match="not this user's private directory"):
                open_private(parent, "cache", "cache", create=False)
            assert (tmp_path / "cache").stat().st_mode & 0o777 == mode
    finally:
        os.close(parent)
