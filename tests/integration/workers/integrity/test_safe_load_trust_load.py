"""Write access to storage never becomes code execution or writes/reads outside a state.

An attacker who can write the run's storage replaces a DeepSpeed shard with a pickle whose
unpickling touches a marker file, and re-commits the manifest so the checksum matches: the marker
never appears on resume (the run falls back to the previous state), ``resume.init_from`` or
``syncpoint digest``, and each refusal is one paragraph naming the class. Manifests naming paths
outside their state (``engine/../../x``) are refused before any byte is written or read.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import tempfile
import uuid

import pytest
import torch

from syncpoint.orchestrator.cli import main
from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, ManifestEntry
from syncpoint.policies.contracts.state_paths import path_problem
from syncpoint.policies.decisions.candidates import Candidate
from syncpoint.workers.integrity.checksum import checksum_bytes, entry
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.checkpoint_engine import StreamingCheckpointEngine
from syncpoint.workers.state.discovery import read_candidate
from syncpoint.workers.state.reader import ChecksumMismatch, StateRefused, fetch_state
from syncpoint.workers.storage import RunStorage
from tests.helpers import lm_spec, run, with_overrides

NEWEST, OLDER = f"{10:012d}", f"{8:012d}"
MODEL = "engine/mp_rank_00_model_states.pt"
SHARD = "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt"


class Touch:
    """Unpickling this calls ``pathlib.Path.touch(marker)``: any code could run the same way."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def payload(marker: pathlib.Path, fmt: str) -> bytes:
    """A DeepSpeed-shaped file whose unpickling creates ``marker``: torch's zip format, or a bare
    protocol-2 pickle (what torch's legacy loader reads first)."""
    obj = {"module": Touch(marker), "optimizer_state_dict": Touch(marker)}
    if fmt == "zip":
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()
    return pickle.dumps(obj, protocol=2)


def plant(store: RunStorage, state: str, rel: str, data: bytes) -> None:
    """Replace one file and re-commit the manifest to match, as a storage writer could."""
    store.write_bytes(data, "states", state, rel)
    manifest = json.loads(store.read_bytes("states", state, "manifest.json", limit=MANIFEST_MAX_BYTES))
    manifest["files"][rel] = entry(len(data), "xxh3_128", checksum_bytes(data, "xxh3_128")).record()
    store.commit_bytes(json.dumps(manifest).encode(), "states", state, "manifest.json")


def one_paragraph(text: str) -> None:
    assert text.strip() and "\n" not in text.strip() and "Traceback" not in text, text


@pytest.mark.parametrize("fmt", ["zip", "raw"])
def test_the_payload_is_live_when_unpickled_the_old_way(tmp_path, fmt):
    """Guard for every test below: torch.load(weights_only=False), what DeepSpeed's own engine
    does, really runs the planted code; syncpoint's checkpoint engine refuses, naming the class."""
    marker, path = tmp_path / "marker", tmp_path / "planted.pt"
    path.write_bytes(payload(marker, fmt))
    refused = r"engine-dir/planted\.pt needs class(es)? .*(pathlib|getattr).*refused \(corrupt\)"
    with pytest.raises(StateRefused, match=refused) as e:
        StreamingCheckpointEngine().load(str(_moved(path, tmp_path / "engine-dir")), map_location="cpu")
    one_paragraph(str(e.value))
    assert not marker.exists()
    try:
        torch.load(tmp_path / "engine-dir" / "planted.pt", weights_only=False)
    except Exception:  # noqa: BLE001 - only whether the planted payload ran matters
        pass
    assert marker.exists()


def _moved(path: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir()
    return path.rename(directory / path.name)


@pytest.mark.parametrize("rel,fmt", [(MODEL, "zip"), (SHARD, "zip"), (SHARD, "raw")])
def test_resume_refuses_a_planted_payload_and_falls_back(tmp_path, crashed, rel, fmt):
    marker = tmp_path / "marker"
    store = RunStorage(crashed.run_url)
    plant(store, NEWEST, rel, payload(marker, fmt))
    result = run(with_overrides(crashed, "faults=[]"))
    assert not marker.exists()
    assert result.resumed_from == OLDER
    decision = [e for e in EventLog(store).read_all() if e["kind"] == "resume_decision"][-1]
    reason = {c["state"]: c["reason"] for c in decision["candidates"]}[NEWEST]
    assert f"{rel} needs class" in reason and "refused (corrupt)" in reason, reason
    one_paragraph(reason)


def test_init_from_refuses_a_planted_payload(tmp_path, crashed):
    marker = tmp_path / "marker"
    plant(RunStorage(crashed.run_url), NEWEST, MODEL, payload(marker, "zip"))
    fine_tune = lm_spec(
        tmp_path / "tune",
        "task.config.num_samples=20",
        "train.max_steps=1",
        f"resume.init_from={crashed.run_url}/states/{NEWEST}",
    )
    with pytest.raises(Exception, match=rf"{MODEL} needs class.*refused \(corrupt\)") as e:
        run(fine_tune)
    one_paragraph(str(e.value))
    assert not marker.exists()


def test_digest_refuses_a_planted_payload_in_one_paragraph(tmp_path, crashed, capsys):
    marker = tmp_path / "marker"
    plant(RunStorage(crashed.run_url), NEWEST, SHARD, payload(marker, "zip"))
    assert main(["digest", f"{crashed.run_url}/states/{NEWEST}"]) == 2
    err = capsys.readouterr().err
    assert f"{SHARD} needs class" in err and "refused (corrupt)" in err, err
    assert "Traceback" not in err and "UnpicklingError" not in err and len(err.strip().splitlines()) <= 2, err
    assert not marker.exists()


# ---- §2: manifests name only paths inside their state


@pytest.mark.parametrize(
    "rel",
    [
        "engine/a.pt",
        "optim/full.safetensors",
        "rng/rank_00000.safetensors",
        "trainer.json",
        "engine/..hidden",
        "engine/a..b",
    ],
)
def test_path_problem_accepts_normalized_relative_paths(rel):
    assert path_problem(rel) is None


@pytest.mark.parametrize(
    "rel",
    [
        "engine/../../x",
        "../x",
        "..",
        "engine/..",
        "/etc/passwd",
        "engine//a.pt",
        "engine/a.pt/",
        "engine/./a.pt",
        ".",
        "",
        "engine\\..\\x",
        "engine/a\x00.pt",
        "engine/a\n.pt",
        "engine/" + "a" * 600,
        None,
        3,
    ],
)
def test_path_problem_refuses_anything_else(rel):
    assert path_problem(rel)


def _escaping_state(store: RunStorage, state: str, rel: str, data: bytes) -> None:
    """A state whose manifest names ``rel`` with the right checksum of ``data`` (stored under the
    literal key, as an object store keeps it, or where the local path resolves: local storage itself
    refuses a '..' name, so the file is put there directly)."""
    local = store.local_path("states", state, rel)
    if local is None:
        store.write_bytes(data, "states", state, rel)
    else:
        with open(local, "wb") as f:
            f.write(data)
    trainer = store.write_json({"schema_version": 1}, "states", state, "trainer.json")
    files = {
        rel: entry(len(data), "xxh3_128", checksum_bytes(data, "xxh3_128")).record(),
        "trainer.json": entry(len(trainer), "xxh3_128", checksum_bytes(trainer, "xxh3_128")).record(),
    }
    store.commit_bytes(json.dumps({"files": files}).encode(), "states", state, "manifest.json")


@pytest.mark.parametrize("url", ["memory", "local"])
def test_fetch_refuses_a_manifest_path_outside_the_state_before_writing(tmp_path, monkeypatch, url):
    """``init_from`` reaches fetch without classification, and object-store keys are literal: a
    ``..`` entry must not write above the fetch directory, even with a matching checksum."""
    fetch_root = tmp_path / "fetch-root"
    fetch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fetch_root))  # where fetch makes its directory
    escaped = f"escaped-{uuid.uuid4().hex}"
    rel = f"engine/../../{escaped}"  # from <fetch-root>/syncpoint-load-*/ up to <fetch-root>/
    store = RunStorage(f"memory://trust-{uuid.uuid4().hex}" if url == "memory" else str(tmp_path / "run"))
    if url == "local":  # locally engine/../../x resolves to states/x: its parents must exist to write it
        (tmp_path / "run" / "states" / "000000000004" / "engine").mkdir(parents=True)
    _escaping_state(store, "000000000004", rel, b"written outside")
    cand = read_candidate(store, "000000000004")
    with pytest.raises(StateRefused, match=r"manifest entry 'engine/\.\./\.\./escaped-\w+' has a '\.\.' segment") as e:
        fetch_state(store, cand, 0, want_rng=False)
    one_paragraph(str(e.value))
    assert not (fetch_root / escaped).exists() and list(fetch_root.iterdir()) == []


def test_a_download_is_renamed_into_place_only_after_its_checksum_matched(tmp_path):
    from syncpoint.workers.state.downloads import download_verified

    store = RunStorage(str(tmp_path / "run"))
    store.write_bytes(b"changed after commit", "states", "000000000004", SHARD)
    local = tmp_path / "fetch"
    local.mkdir()
    info = ManifestEntry(
        **entry(len(b"what was committed!!"), "xxh3_128", checksum_bytes(b"what was committed!!", "xxh3_128")).record()
    )
    with pytest.raises(ChecksumMismatch, match="xxh3_128 does not match"):
        download_verified(store, "000000000004", SHARD, info, str(local))
    assert not (local / SHARD).exists()
    assert [p for p in local.rglob("*") if p.is_file()] == []  # nor the temporary download
    good = ManifestEntry(
        **entry(len(b"changed after commit"), "xxh3_128", checksum_bytes(b"changed after commit", "xxh3_128")).record()
    )
    download_verified(store, "000000000004", SHARD, good, str(local))
    assert (local / SHARD).read_bytes() == b"changed after commit"


def test_fetch_refuses_a_manifest_entry_without_a_checksum(tmp_path):
    cand = Candidate(name="000000000004", manifest={"files": {MODEL: {"size": 3}}})
    with pytest.raises(StateRefused, match=rf"{MODEL} names no known checksum algorithm"):
        fetch_state(RunStorage(str(tmp_path / "run")), cand, 0)


def test_digest_reads_nothing_outside_the_state(tmp_path, crashed, capsys):
    """A manifest entry ``rng/../../<other state>/...`` would make digest read (and hash) another
    state's file; it is refused before any file is read."""
    store = RunStorage(crashed.run_url)
    rel = f"rng/../../{OLDER}/rng/rank_00000.safetensors"
    data = store.read_bytes("states", OLDER, "rng/rank_00000.safetensors", limit=1 << 30)
    manifest = json.loads(store.read_bytes("states", NEWEST, "manifest.json", limit=MANIFEST_MAX_BYTES))
    manifest["files"][rel] = entry(len(data), "xxh3_128", checksum_bytes(data, "xxh3_128")).record()
    store.commit_bytes(json.dumps(manifest).encode(), "states", NEWEST, "manifest.json")
    assert main(["digest", f"{crashed.run_url}/states/{NEWEST}"]) == 2
    err = capsys.readouterr().err
    assert "has a '..' segment" in err and "refused" in err, err


# ---- the load path has no way around the allowlist


def test_install_refuses_deepspeeds_universal_checkpoint_load_path():
    """``checkpoint.load_universal`` makes DeepSpeed torch.load(weights_only=False) past any engine."""
    import types

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from syncpoint.policies.contracts.errors import JobConfigError
    from syncpoint.workers.state.checkpoint_engine import install

    engine = types.SimpleNamespace(
        checkpoint_engine=TorchCheckpointEngine(None), _config=None, load_universal_checkpoint=lambda: True
    )
    with pytest.raises(JobConfigError, match=r"checkpoint\.load_universal.*weights_only=False"):
        install(engine)


def test_an_elastic_full_state_that_does_not_fit_is_refused_before_loading(tmp_path):
    """The gathered optimizer state is scattered after DeepSpeed loaded the weights: it is checked
    first, so a missing tensor cannot leave a half-loaded engine."""
    import types

    from safetensors.torch import save_file

    from syncpoint.workers.state.elastic_state import check_full_optimizer_state

    engine = types.SimpleNamespace(module=torch.nn.Linear(2, 3))  # what the check reads of an engine
    tensors = {
        f"{n}::{k}": torch.zeros_like(p)
        for n, p in engine.module.named_parameters()
        for k in ("fp32", "exp_avg", "exp_avg_sq")
    }
    meta = {"keys": json.dumps(["exp_avg", "exp_avg_sq"]), "step": "3.0"}
    good, short, junk = tmp_path / "good", tmp_path / "short", tmp_path / "junk"
    save_file(tensors, str(good), metadata=meta)
    save_file({k: v for k, v in tensors.items() if k != "bias::exp_avg"}, str(short), metadata=meta)
    junk.write_bytes(payload(tmp_path / "marker", "zip"))
    check_full_optimizer_state(engine, str(good))
    with pytest.raises(StateRefused, match=r"optim/full\.safetensors: bias::exp_avg is missing"):
        check_full_optimizer_state(engine, str(short))
    with pytest.raises(StateRefused, match=r"optim/full\.safetensors: not a safetensors file"):
        check_full_optimizer_state(engine, str(junk))
    assert not (tmp_path / "marker").exists()
