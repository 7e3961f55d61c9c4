"""Sampler versions: the per-position order is the default for new runs, a state written with the
materialised permutation resumes with it to the same samples, an unknown sampler is refused at
selection, and ``syncpoint states`` says which sampler each state uses."""

from __future__ import annotations

import json

from syncpoint.policies.contracts.state_format import LEGACY_SAMPLER, SAMPLER_VERSION
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.state import resume_negotiation
from syncpoint.workers.storage import RunStorage
from tests.helpers import cli, digest, linear_spec, run, run_until_crash, step_history, trainer_json, with_overrides


def _spec(tmp, *extra):
    return linear_spec(
        tmp,
        "task.config.num_samples=10",
        "train.grad_accum=4",
        "train.epochs=2",
        "train.record_samples=true",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *extra,
    )


def _samples(spec) -> dict[int, list[int]]:
    return {step: rec.samples for step, rec in step_history(spec).items()}


def test_a_state_written_with_the_legacy_sampler_resumes_to_the_same_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(resume_negotiation, "NEW_RUN_SAMPLER", LEGACY_SAMPLER)  # syncpoint before feistel/v1
    ref = _spec(tmp_path / "ref")
    final = run(ref).final_state
    crashed = _spec(tmp_path / "run", "faults=[{at_micro_step: 12, mode: raise}]")
    assert run_until_crash(crashed)
    monkeypatch.undo()  # this syncpoint: new runs would use feistel/v1, this one continues its own
    result = run(with_overrides(crashed, "faults=[]"))
    assert result.resumed_from == f"{10:012d}" and result.final_state == final
    assert trainer_json(crashed, final)["data"]["sampler"] == LEGACY_SAMPLER
    assert _samples(crashed) == _samples(ref)
    assert digest(crashed, final) == digest(ref, final)
    fresh = _spec(tmp_path / "fresh")
    run(fresh)
    assert trainer_json(fresh, final)["data"]["sampler"] == SAMPLER_VERSION
    assert _samples(fresh) != _samples(ref)  # another order: the new default


def test_an_unknown_sampler_is_refused_at_selection_and_states_shows_each_sampler(tmp_path, capsys):
    spec = _spec(tmp_path, "faults=[{at_micro_step: 12, mode: raise}]")
    assert run_until_crash(spec)
    store, newest = RunStorage(spec.run_url), f"{10:012d}"
    t = trainer_json(spec, newest)
    t["data"]["sampler"] = "quantum/v9"  # a newer syncpoint's, say
    data = store.write_json(t, "states", newest, "trainer.json")
    manifest = json.loads(store.read_bytes("states", newest, "manifest.json", limit=1 << 30))
    manifest["files"]["trainer.json"] = {"size": len(data), "xxh3_128": checksum_bytes(data, "xxh3_128")}
    store.commit_bytes(json.dumps(manifest).encode(), "states", newest, "manifest.json")
    rc, out, _ = cli(capsys, "states", spec.run_url.removeprefix("file://"), "--json")
    assert rc == 0
    rows = {c["state"]: c for c in json.loads(out)["candidates"]}
    assert (
        rows[newest]["verdict"] == "incompatible"
        and "sampler ('quantum/v9') is not one this syncpoint knows" in rows[newest]["reason"]
    )
    assert rows[f"{8:012d}"]["verdict"] == "resumable" and f"sampler {SAMPLER_VERSION}" in rows[f"{8:012d}"]["reason"]
    assert run(with_overrides(spec, "faults=[]")).resumed_from == f"{8:012d}"
