"""Two ranks of one node restore a state reading each file once between them
(``syncpoint.workers.state.node_share``), and sharing never changes what is refused.

The ranks are real processes in a gloo group that call the real ``fetch_state``; a spy records
which files each rank checksummed or downloaded itself (the reads are the project's own).
"""

from __future__ import annotations

import os
import traceback

import pytest

from syncpoint.policies.decisions.seeds import hash_seed
from syncpoint.workers.integrity.verified_files import available
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision import fork_context
from syncpoint.workers.supervision.free_ports import free_port
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import committed_steps, lm_spec

MODEL = "engine/mp_rank_00_model_states.pt"
HASH_SEED = str(hash_seed(lm_spec("/unused").train.seed))  # the runs' own: their fork server is reused
TIMEOUT_S = 120  # a rank waiting forever in a gather fails the test instead of hanging it


@pytest.fixture(scope="module")
def crashed_two_ranks(tmp_path_factory):
    """A ZeRO-2 run of 2 ranks on local storage with committed states, crashed at micro-step 10."""
    spec = lm_spec(
        tmp_path_factory.mktemp("share") / "run",
        "task.config.num_samples=40",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 10, mode: raise}]",
        workers=2,
    )
    assert run_spawned(spec)[0] != 0
    return spec, f"{max(committed_steps(spec)):012d}"


def _rank(rank: int, port: int, url: str, name: str, how: dict, out) -> None:
    """One rank: join the group, fetch with peers (or fail first, ``how['fail_before']``), report."""
    import torch.distributed as dist

    from syncpoint.workers.integrity import verified_files
    from syncpoint.workers.state import downloads, reader
    from syncpoint.workers.state.discovery import read_candidate
    from syncpoint.workers.state.node_share import NodePeers
    from syncpoint.workers.storage import RunStorage

    hashed: list[str] = []
    checksum_fd, download, fetch_range = (
        verified_files.checksum_fd,
        downloads.download_verified,
        downloads.SplitDownload._fetch,
    )

    def spy_checksum(fd, *a, **k):
        hashed.append(os.readlink(f"/proc/self/fd/{fd}").split("/engine/")[-1])
        return checksum_fd(fd, *a, **k)

    def spy_download(storage, state, rel, *a, **k):
        hashed.append(rel.split("/")[-1])
        return download(storage, state, rel, *a, **k)

    def spy_range(split, rel, path, start, end, at=None):
        hashed.append(f"range {rel.split('/')[-1]} {start} {end}")
        if how.get("failed_pieces") and at == 0:  # a range for another rank: storage fails it
            raise OSError("injected: the range's download failed")
        fetch_range(split, rel, path, start, end, at)
        if how.get("garbage_pieces") and at == 0:  # a range for another rank, its bytes wrong
            with open(path, "r+b") as f:
                f.write(b"\xff" * 64)

    verified_files.checksum_fd, downloads.download_verified = spy_checksum, spy_download
    downloads.SplitDownload._fetch = spy_range
    if "min_piece" in how:  # test-sized files: read ahead pieces of any size, and record each
        import functools

        from syncpoint.policies.decisions import shared_reads
        from syncpoint.workers.state import node_share

        node_share.prefetch_pieces = functools.partial(shared_reads.prefetch_pieces, min_piece=how["min_piece"])
        read_ahead = verified_files.read_ahead

        def spy_ahead(root, rel, start, end):
            hashed.append(f"ahead {rel.split('/')[-1]} {start} {end}")
            return read_ahead(root, rel, start, end)

        verified_files.read_ahead = spy_ahead
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        peers = NodePeers()
        if rank in how.get("fail_before", ()):
            peers.finish()  # what _fetch_and_load does when it fails before fetching
            out.put((rank, "failed before", hashed, {}))
        else:
            store = RunStorage(url)
            own = rank if how["own_shard"] else None
            try:
                fetched = reader.fetch_state(
                    store, read_candidate(store, name), rank, own_shard=own, in_place=how["in_place"], peers=peers
                )
            except Exception as e:  # noqa: BLE001 - reported to the test
                out.put((rank, f"{type(e).__name__}: {e}", hashed, {}))
            else:
                fetched.unchanged()
                inodes = {
                    rel: os.stat(f.path if fetched.verified else os.path.join(fetched.local_dir, rel)).st_ino
                    for rel, f in (fetched.verified or {r: None for r in _engine_files(fetched.local_dir)}).items()
                }
                dist.barrier()  # the other rank's links are made before this one's directory goes
                fetched.cleanup()
                out.put((rank, "ok", hashed, inodes))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the test, whatever it was
        out.put((rank, traceback.format_exc(), hashed, {}))
    finally:
        dist.destroy_process_group()


def _engine_files(local_dir: str) -> list[str]:
    return [f"engine/{f}" for f in os.listdir(os.path.join(local_dir, "engine"))]


def _fetch_on_two_ranks(url: str, name: str, **how) -> dict[int, tuple[str, list[str], dict[str, int]]]:
    # forked from this process's fork server, which has torch and DeepSpeed imported (the ranks' runs
    # started it with the job's hash seed): a spawned interpreter each cost ~3 s of CPU importing them
    ctx = fork_context.context("forkserver", HASH_SEED)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, url, name, how, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, status, hashed, inodes = out.get(timeout=TIMEOUT_S)
            results[rank] = (status, hashed, inodes)
        return results
    finally:
        for p in procs:  # only the processes this test started
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _shard(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


needs_fd = pytest.mark.skipif(not available(), reason="in-place reads need /proc/self/fd")


@needs_fd
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "downloaded"])
def test_the_model_file_both_ranks_load_is_read_once_per_node(crashed_two_ranks, in_place):
    spec, name = crashed_two_ranks
    results = _fetch_on_two_ranks(spec.run_url, name, in_place=in_place, own_shard=True)
    assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    read = {r: sorted(results[r][1]) for r in (0, 1)}
    assert sorted(read[0] + read[1]) == sorted(["mp_rank_00_model_states.pt", _shard(0), _shard(1)]), read
    assert _shard(0) in read[0] and _shard(1) in read[1]  # each rank still reads its own shard
    inodes = {r: results[r][2] for r in (0, 1)}
    assert inodes[0][MODEL] == inodes[1][MODEL]  # the very file the other rank verified
    assert set(inodes[0]) >= {MODEL, f"engine/{_shard(0)}"} and set(inodes[1]) >= {MODEL, f"engine/{_shard(1)}"}


@needs_fd
def test_a_rank_reads_ahead_the_tail_of_the_file_the_other_checksums(crashed_two_ranks):
    """Local storage: rank 1, with less to read, reads the model file's tail ahead (its half of the
    node's bytes) before its own shard; rank 0 checksums its own shard first, then the model file
    whole; both take the same verified file, and nothing read ahead decides anything."""
    spec, name = crashed_two_ranks
    results = _fetch_on_two_ranks(spec.run_url, name, in_place=True, own_shard=True, min_piece=1)
    assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    start, size = _split_point(spec, name)
    assert results[1][1] == [f"ahead mp_rank_00_model_states.pt {start} {size}", _shard(1)], results[1][1]
    assert results[0][1] == [_shard(0), "mp_rank_00_model_states.pt"], results[0][1]
    assert results[0][2][MODEL] == results[1][2][MODEL]


def _split_point(spec, name: str) -> tuple[int, int]:
    """Where the model file's tail that rank 1 takes on starts (half the node's bytes each), its size."""
    state = RunStorage(spec.run_url).local_path("states", name) or ""
    size = os.path.getsize(os.path.join(state, MODEL))
    shard = {r: os.path.getsize(os.path.join(state, "engine", _shard(r))) for r in (0, 1)}
    return size - (size + shard[0] - shard[1]) // 2, size


@needs_fd
def test_a_download_of_the_shared_file_is_split_between_the_nodes_ranks(crashed_two_ranks):
    """Object-store path: rank 1 downloads its shard, then the model file's tail for rank 0; rank 0
    its shard, then the head; rank 0 completes the file from rank 1's range and checksums it whole,
    and rank 1 takes that verified file."""
    spec, name = crashed_two_ranks
    results = _fetch_on_two_ranks(spec.run_url, name, in_place=False, own_shard=True, min_piece=1)
    assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    start, size = _split_point(spec, name)
    assert results[1][1] == [_shard(1), f"range mp_rank_00_model_states.pt {start} {size}"], results[1][1]
    assert results[0][1] == [_shard(0), f"range mp_rank_00_model_states.pt 0 {start}"], results[0][1]
    assert results[0][2][MODEL] == results[1][2][MODEL]


@needs_fd
def test_a_range_another_rank_could_not_download_is_fetched_by_the_reader(crashed_two_ranks):
    spec, name = crashed_two_ranks
    results = _fetch_on_two_ranks(spec.run_url, name, in_place=False, own_shard=True, min_piece=1, failed_pieces=1)
    assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    start, size = _split_point(spec, name)
    model = "mp_rank_00_model_states.pt"
    assert results[0][1] == [_shard(0), f"range {model} 0 {start}", f"range {model} {start} {size}"], results[0][1]
    assert results[0][2][MODEL] == results[1][2][MODEL]


@needs_fd
def test_wrong_bytes_from_another_rank_never_refuse_a_state(crashed_two_ranks):
    """Rank 1's range is wrong (as if its disk or its read had failed): the completed file fails its
    checksum, and rank 0 downloads the file whole itself; that download decides, and it is good."""
    spec, name = crashed_two_ranks
    results = _fetch_on_two_ranks(spec.run_url, name, in_place=False, own_shard=True, min_piece=1, garbage_pieces=1)
    assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    start, _ = _split_point(spec, name)
    model = "mp_rank_00_model_states.pt"
    assert results[0][1] == [_shard(0), f"range {model} 0 {start}", model], results[0][1]
    assert results[0][2][MODEL] == results[1][2][MODEL]


@needs_fd
def test_files_every_rank_needs_are_split_between_the_nodes_ranks(crashed_two_ranks):
    """Without ``own_shard`` (another world size, a ZeRO-3 module-only load) each rank needs every
    file: each is read once."""
    spec, name = crashed_two_ranks
    results = _fetch_on_two_ranks(spec.run_url, name, in_place=True, own_shard=False)
    assert [results[r][0] for r in (0, 1)] == ["ok", "ok"], results
    read = {r: results[r][1] for r in (0, 1)}
    assert read[0] and read[1] and not set(read[0]) & set(read[1]), read
    assert sorted(read[0] + read[1]) == sorted(["mp_rank_00_model_states.pt", _shard(0), _shard(1)])


@needs_fd
@pytest.mark.parametrize(
    ("in_place", "min_piece"), [(True, None), (False, None), (False, 1)], ids=["in place", "downloaded", "in ranges"]
)
def test_a_changed_shared_file_is_refused_by_every_rank(crashed_two_ranks, tmp_path, in_place, min_piece):
    """Rank 0 reads the model file and refuses it; rank 1, offered nothing, checks it itself. In
    ranges: the completed file fails, and rank 0's own whole download decides."""
    import shutil

    from syncpoint.workers.storage import RunStorage

    spec, name = crashed_two_ranks
    state_dir = RunStorage(spec.run_url).local_path("states", name)
    assert state_dir is not None
    copy = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(state_dir)), copy)
    path = copy / "states" / name / MODEL
    data = bytearray(path.read_bytes())
    data[200] ^= 0x01
    path.write_bytes(bytes(data))
    pieces = {} if min_piece is None else {"min_piece": min_piece}
    results = _fetch_on_two_ranks(str(copy), name, in_place=in_place, own_shard=True, **pieces)
    for r in (0, 1):
        status, read, _ = results[r]
        assert status.startswith("ChecksumMismatch") and "mp_rank_00_model_states.pt" in status, results
        assert "mp_rank_00_model_states.pt" in read  # both checked it: nobody took an unverified file


@needs_fd
def test_a_rank_that_fails_before_fetching_never_leaves_the_other_waiting(crashed_two_ranks):
    spec, name = crashed_two_ranks
    results = _fetch_on_two_ranks(spec.run_url, name, in_place=True, own_shard=True, fail_before=(1,))
    assert results[1][0] == "failed before" and results[0][0] == "ok", results
    assert sorted(results[0][1]) == sorted(["mp_rank_00_model_states.pt", _shard(0)])  # it read what it needs
