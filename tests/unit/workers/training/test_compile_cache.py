"""``train.compile``'s cache on a node (``syncpoint.workers.training.compile_cache``): this user's
private directory, made 0700, refused when it is a link, open to others or another account's; a
directory the user named is theirs."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from syncpoint.policies.contracts.errors import JobConfigError
from syncpoint.workers.training.compile_cache import INDUCTOR, TRITON, private_compile_cache


@pytest.fixture
def tmp(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_cache_is_made_private_and_inductor_and_triton_point_at_it(tmp):
    env: dict[str, str] = {}
    path = private_compile_cache(env)
    assert path == str(tmp / f"syncpoint-compile-{os.getuid()}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and os.stat(path).st_uid == os.getuid()
    assert env == {INDUCTOR: path, TRITON: os.path.join(path, "triton")}
    assert private_compile_cache({}) == path  # the next process on the node finds the same one


def test_a_directory_the_user_named_is_used_as_it_is(tmp):
    env = {INDUCTOR: "/data/my-cache"}
    assert private_compile_cache(env) == "/data/my-cache"
    assert env[TRITON] == "/data/my-cache/triton"
    assert not (tmp / f"syncpoint-compile-{os.getuid()}").exists()


def test_a_planted_link_is_refused_naming_the_field_and_the_fix(tmp):
    other = tmp / "planted"
    other.mkdir(mode=0o700)
    (tmp / f"syncpoint-compile-{os.getuid()}").symlink_to(other)
    with pytest.raises(JobConfigError, match=r"train\.compile: .*\(a link or not a directory\).*Remove it"):
        private_compile_cache({})


def test_a_directory_open_to_others_is_refused(tmp):
    path = tmp / f"syncpoint-compile-{os.getuid()}"
    path.mkdir()
    path.chmod(0o777)
    with pytest.raises(JobConfigError, match=r"mode 777"):
        private_compile_cache({})


@pytest.mark.skipif(os.geteuid() != 0, reason="making another account's directory needs root")
def test_another_accounts_directory_is_refused(tmp):
    path = tmp / f"syncpoint-compile-{os.getuid()}"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, -1)
    with pytest.raises(JobConfigError, match=r"owner uid 65534"):
        private_compile_cache({})
