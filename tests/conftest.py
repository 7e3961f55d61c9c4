"""The suite's tiers, the markers each tier's directory sets, and the fixtures several modules share.

Each directory under ``tests/`` is a tier; a test's directory, not a decorator, says what it needs:

========================  ===================  ============================================================
directory                 markers it sets      what its tests do
========================  ===================  ============================================================
``tests/unit/``           none                 pure functions and records: no engine, no subprocess
``tests/integration/``    none                 DeepSpeed on a torch process group, spawned ranks, storage
                                               (moto's S3 server included), the CLI in-process; no Ray
``tests/k8s/``            none                 the manifests under ``k8s/`` and ``syncpoint k8s``, offline
``tests/ray/``            ``ray``, ``slow``    start a Ray cluster (local, ``Cluster`` or ``ray start``)
``tests/drills/``         ``long``, ``slow``   whole-job drills and the long property runs, without Ray
``tests/drills/ray/``     ``long``, ``slow``,  the same on a Ray cluster (the storm tests add ``storm``
                          ``ray``              themselves)
========================  ===================  ============================================================

Per-test marks remain only where a test differs from its directory: ``slow`` on the slower
integration tests, ``gpu`` on ``tests/integration/workers/training/test_device_gpu.py``, ``storm`` on the storm
drills, and
``long`` on the parametrized cases of an integration test whose other cases are short (the function
stays in one place; its long cases run with the drills: ``-m long``). ``docs/testing.md`` has the table
with the time each tier takes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.filterwarnings("ignore")

TESTS = Path(__file__).resolve().parent
# a directory under tests/ -> the markers every test in it (and below it) carries
DIRECTORY_MARKS: dict[str, tuple[str, ...]] = {
    "unit": ("unit",),
    "integration": ("integration",),
    "ray": ("ray", "slow"),
    "drills": ("drills", "long", "slow"),
    "drills/ray": ("ray",),
    "k8s": ("k8s",),
}


def directory_marks(path: Path) -> list[str]:
    """The markers a test module at ``path`` gets from its directories, outermost first."""
    try:
        parts = path.resolve().relative_to(TESTS).parent.parts
    except ValueError:
        return []
    marks: list[str] = []
    for depth in range(1, len(parts) + 1):
        marks += DIRECTORY_MARKS.get("/".join(parts[:depth]), ())
    return marks


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    astray = []
    for item in items:
        for name in directory_marks(item.path):
            if name not in {m.name for m in item.iter_markers()}:
                item.add_marker(name)
        if ray_test_make_test_would_miss(item.path, {m.name for m in item.iter_markers()}):
            astray.append(item.nodeid)
    if astray:
        raise pytest.UsageError(
            f"{astray[0]} (and {len(astray) - 1} more) is marked `ray` and not `long` outside tests/ray/: make "
            "test's Ray half collects only tests/ray/ and its other half leaves out `ray`, so it would run "
            "nowhere. Move it under tests/ray/, or mark it `long`."
        )


def ray_test_make_test_would_miss(path: Path, marks: set[str]) -> bool:
    """Whether `make test` would run this test in neither half: its Ray half collects tests/ray/ alone
    (collecting every module cost it seconds of CPU for 17 tests), the other half deselects `ray`."""
    if "ray" not in marks or "long" in marks:
        return False
    try:
        return path.resolve().relative_to(TESTS).parts[0] != "ray"
    except ValueError:
        return False


# ---------------------------------------------------------------- moto's S3 server


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """moto's S3 server on 127.0.0.1:<free port>, a bucket, and fsspec/s3fs pointed at it (one per
    module that asks); yields a boto3 client on it."""
    from tests.s3_server import moto_s3

    with moto_s3() as client:
        yield client


# ---------------------------------------------------------------- Ray clusters


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[Any]:
    """One multi-node cluster for a module's node tests (starting one costs ~20 s of CPU here).
    Each test leaves it as it found it: a head and two live one-CPU worker nodes (it replaces the
    node it takes away, as the autoscaler would) and no running job (the driver has exited)."""
    from ray.cluster_utils import Cluster

    from tests.own_processes import MARK, marked_env

    # Every process of the cluster (its daemons, the nodes a test adds, the workers their raylets
    # start) carries the module's mark, so what `shutdown()` leaves behind is found and ended.
    before = os.environ.get(MARK)
    _, mark = marked_env({})
    os.environ[MARK] = mark
    try:
        # fast GCS health checks so a killed node is declared dead within seconds
        c = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
            },
        )
        try:
            for _ in range(2):
                c.add_node(num_cpus=1)
            c.wait_for_nodes()
            yield c
        finally:
            _shutdown_leaving_nothing(c, mark)
    finally:
        if before is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = before


def _shutdown_leaving_nothing(cluster: Any, mark: str, timeout: float = 30.0) -> None:
    """``Cluster.shutdown()``, then an end to every process of the cluster still alive. The list is
    taken before the shutdown, while the raylets still parent their workers (a worker renames
    itself, which hides its mark, and a dead raylet's worker is re-parented to init): a Train
    controller busy in a call survived ``shutdown()`` by 15 minutes in one `make test`."""
    import psutil

    from tests.own_processes import owned

    me = os.getpid()
    procs = [p for p in owned(mark) if p.pid != me]
    cluster.shutdown()
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"the shared cluster's processes outlived it: {alive}"


@pytest.fixture
def cluster(local_cluster: Any) -> Iterator[tuple[Any, list[Any]]]:
    workers = list(local_cluster.worker_nodes)
    assert len(workers) == 2, "a previous test left the shared cluster without two worker nodes"
    yield local_cluster, workers
    local_cluster.wait_for_nodes()


@pytest.fixture(scope="module")
def ray_start_cluster() -> Iterator[tuple[Any, list[Any]]]:
    """A `ray start --head` with no CPUs and two `ray start --block` worker nodes that drain on SIGTERM."""
    from tests.ray_processes import drain_env, local_head, worker_nodes

    # fast GCS health checks: the drained node's death is noticed within seconds of its deadline
    config = '{"health_check_period_ms": 500, "health_check_failure_threshold": 4}'
    with local_head(drain_env(), num_cpus=0, system_config=config) as head, worker_nodes(head, 2, drain_env()) as nodes:
        yield head, nodes


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """No Ray token anywhere: a clean environment and an empty home directory."""
    from tests.ray_processes import TOKEN_ENV

    for var in TOKEN_ENV:
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return str(home)


# ---------------------------------------------------------------- the property runs


@pytest.fixture(scope="module")
def workdir() -> Iterator[str]:
    """A directory for a module's hypothesis examples (they cannot take the function-scoped tmp_path)."""
    d = tempfile.mkdtemp(prefix="syncpoint-changes-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
