"""Authenticated states (``checkpoint.signing_key_env``): signed manifests resume; unsigned,
re-signed-by-someone-else and edited states are untrusted before anything of them is loaded."""

from __future__ import annotations

import json

import pytest

from syncpoint.orchestrator.spec_file import parse_spec
from syncpoint.policies.contracts.errors import JobConfigError, ResumeRefused, SpecError
from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, TRAINER_MAX_BYTES
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.integrity.signing import canonical_bytes, sign, trust_problem
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import EXAMPLE, committed_steps, digest, linear_spec, run, run_until_crash, with_overrides

KEY = "k" * 40
SIGNED = ["checkpoint.checksum=sha256", "checkpoint.signing_key_env=SYNCPOINT_TEST_KEY"]


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    monkeypatch.setenv("SYNCPOINT_TEST_KEY", KEY)
    monkeypatch.setenv("OTHER_RUN_KEY", "o" * 40)


def _spec(tmp, *extra):
    return linear_spec(
        tmp,
        "task.config.num_samples=10",
        "train.grad_accum=4",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *extra,
    )


def _crashed(tmp, *extra):
    spec = _spec(tmp, *SIGNED, "faults=[{at_micro_step: 12, mode: raise}]", *extra)
    assert run_until_crash(spec)
    assert committed_steps(spec) == [4, 8, 10]
    return spec


def _manifest(spec, name):
    return json.loads(RunStorage(spec.run_url).read_bytes("states", name, "manifest.json", limit=MANIFEST_MAX_BYTES))


def _verdicts(spec) -> dict[str, tuple[str, str]]:
    d = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "resume_decision"][-1]
    return {c["state"]: (c["verdict"], c["reason"]) for c in d["candidates"]}


def test_signed_states_resume_exactly(tmp_path):
    ref = run(_spec(tmp_path / "ref", *SIGNED))
    spec = _crashed(tmp_path / "run")
    assert trust_problem(_manifest(spec, "000000000010"), KEY.encode()) is None
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == "000000000010"
    assert digest(spec, result.final_state) == digest(_spec(tmp_path / "ref"), ref.final_state)


def test_unsigned_states_are_untrusted_when_signing_is_on(tmp_path):
    spec = _spec(tmp_path, "checkpoint.checksum=sha256", "faults=[{at_micro_step: 12, mode: raise}]")
    assert run_until_crash(spec)  # written without a key
    with pytest.raises(ResumeRefused, match="untrusted: unsigned"):
        run(with_overrides(spec, *SIGNED, "faults=[]"))


def test_a_state_re_committed_without_the_key_is_untrusted_and_the_run_falls_back(tmp_path):
    spec = _crashed(tmp_path)
    store = RunStorage(spec.run_url)
    # an attacker with storage access rewrites trainer.json and re-commits a matching manifest
    t = json.loads(store.read_bytes("states", "000000000010", "trainer.json", limit=TRAINER_MAX_BYTES))
    t["metrics"]["loss"] = -1.0
    data = store.write_json(t, "states", "000000000010", "trainer.json")
    m = _manifest(spec, "000000000010")
    m["files"]["trainer.json"] = {"size": len(data), "sha256": checksum_bytes(data, "sha256")}
    store.commit_bytes(json.dumps(m).encode(), "states", "000000000010", "manifest.json")
    # and signs a second one with a key of their own
    m8 = sign(_manifest(spec, "000000000008"), b"attacker-key-" + b"x" * 32)
    store.commit_bytes(json.dumps(m8).encode(), "states", "000000000008", "manifest.json")
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == "000000000004"
    v = _verdicts(spec)
    assert v["000000000010"] == (
        "untrusted",
        "signature does not match this run's key (written or changed by someone without it)",
    )
    assert v["000000000008"][0] == "untrusted"


def test_init_from_an_untrusted_run_is_refused_unless_its_key_is_given(tmp_path):
    source = _spec(tmp_path / "src", "checkpoint.checksum=sha256", "checkpoint.signing_key_env=OTHER_RUN_KEY")
    run(source)
    target = _spec(tmp_path / "dst", *SIGNED, f"resume.init_from={source.run_url}", "train.epochs=1")
    with pytest.raises(ResumeRefused, match="untrusted"):
        run(target)
    assert run(with_overrides(target, "resume.init_from_signing_key_env=OTHER_RUN_KEY")).resumed_from is None


def test_signing_needs_sha256_a_set_and_long_enough_key(tmp_path, monkeypatch):
    with pytest.raises(SpecError, match="checkpoint.checksum: sha256"):
        parse_spec(EXAMPLE, "x", ["checkpoint.signing_key_env=SYNCPOINT_TEST_KEY"])
    monkeypatch.delenv("SYNCPOINT_TEST_KEY")
    with pytest.raises(JobConfigError, match="SYNCPOINT_TEST_KEY is not set"):
        run(_spec(tmp_path / "a", *SIGNED))
    monkeypatch.setenv("SYNCPOINT_TEST_KEY", "short")
    with pytest.raises(JobConfigError, match="at least 32"):
        run(_spec(tmp_path / "b", *SIGNED))


def test_signature_rules():
    key = KEY.encode()
    m = {"format": "syncpoint-state/1", "files": {"trainer.json": {"size": 2, "sha256": "ab"}}}
    signed = sign(m, key)
    assert trust_problem(signed, key) is None
    assert canonical_bytes(signed) == canonical_bytes(m)  # the signature covers everything but itself
    tampered = json.loads(json.dumps(signed))
    tampered["files"]["trainer.json"]["size"] = 3
    assert "does not match" in trust_problem(tampered, key)
    xxh = sign({"files": {"a": {"size": 1, "xxh3_128": "ab"}}}, key)
    assert "sha256" in trust_problem(xxh, key)
    assert "unsigned" in trust_problem(m, key)


def test_states_cli_verifies_signatures_when_given_the_key(tmp_path, capsys):
    from syncpoint.orchestrator.cli import main

    spec = _spec(tmp_path, "checkpoint.checksum=sha256", "train.max_steps=2", "train.epochs=null")
    run(spec)  # unsigned
    capsys.readouterr()
    run_dir = spec.run_url.removeprefix("file://")
    assert main(["states", run_dir, "--json"]) == 0
    assert {c["verdict"] for c in json.loads(capsys.readouterr().out)["candidates"]} == {"resumable"}
    assert main(["states", run_dir, "--json", "--signing-key-env", "SYNCPOINT_TEST_KEY"]) == 0
    assert {c["verdict"] for c in json.loads(capsys.readouterr().out)["candidates"]} == {"untrusted"}


def _copy_state(src_spec, dst_spec, name: str, as_name: str | None = None) -> None:
    import shutil

    src, dst = RunStorage(src_spec.run_url), RunStorage(dst_spec.run_url)
    shutil.copytree(src.path("states", name), dst.path("states", as_name or name))


def test_a_signed_state_replayed_into_another_run_directory_is_untrusted_there(tmp_path):
    """Same key, same job name, another storage location: the attacker copies run A's newer signed state
    into run B. The signature binds the run directory that wrote it, so B refuses it and resumes its own."""
    a = _spec(tmp_path / "a", *SIGNED)
    run(a)  # finished: states up to 20
    b = _crashed(tmp_path / "b")  # states 4, 8, 10
    _copy_state(a, b, "000000000020")
    result = run(with_overrides(b, "faults=[]"))
    assert result.resumed_from == "000000000010"
    verdict, reason = _verdicts(b)["000000000020"]
    assert verdict == "untrusted" and "signed for another run directory" in reason and "init_from" in reason
    assert digest(b, result.final_state) == digest(a, "000000000020")  # its own resume is exact all the same


def test_a_signed_state_renamed_to_look_newer_is_untrusted(tmp_path):
    spec = _crashed(tmp_path)
    _copy_state(spec, spec, "000000000008", as_name="000000000030")
    with pytest.raises(ResumeRefused):  # the copy is refused first, by its binding
        run(with_overrides(spec, "resume.policy=pinned", "resume.policy_args={state: 30}", "faults=[]"))
    result = run(with_overrides(spec, "faults=[]"))
    assert result.resumed_from == "000000000010"
    # the manifest's own state name gives it away first; the binding (bound to the name too) would next
    assert _verdicts(spec)["000000000030"] == (
        "corrupt",
        "manifest names state '000000000008' but lies in directory 000000000030",
    )


def test_the_binding_is_inside_the_signature_and_names_what_differs():
    key = KEY.encode()
    m = {
        "format": "syncpoint-state/1",
        "files": {"trainer.json": {"size": 2, "sha256": "ab"}},
        "binding": {"run": "file:///data/runs/job", "state": "000000000008", "job_identity": "j1"},
    }
    signed = sign(m, key)
    assert trust_problem(signed, key, run_url="/data/runs/job", state="000000000008", job_identity="j1") is None
    assert trust_problem(signed, key, run_url="file:///data/runs/job/", state="000000000008") is None
    assert "another run directory" in trust_problem(signed, key, run_url="/data/other/job", state="000000000008")
    assert "renamed" in trust_problem(signed, key, run_url="/data/runs/job", state="000000000009")
    assert "job identity" in trust_problem(
        signed, key, run_url="/data/runs/job", state="000000000008", job_identity="j2"
    )
    rebound = json.loads(json.dumps(signed))
    rebound["binding"]["run"] = "file:///data/other/job"  # re-pointing the binding breaks the signature
    assert "does not match" in trust_problem(rebound, key, run_url="/data/other/job", state="000000000008")


@pytest.mark.parametrize(
    "value, says",
    [
        (12345, "signature value 12345 is not a hmac-sha256"),
        ("zz", "signature value 'zz' is not a hmac-sha256"),
        (None, "signature value None"),
    ],
)
def test_a_malformed_signature_value_is_named_as_such(value, says):
    signed = sign({"files": {"a": {"size": 1, "sha256": "ab"}}}, KEY.encode())
    signed["signature"]["value"] = value
    assert says in trust_problem(signed, KEY.encode())


def test_a_state_signed_before_signatures_were_bound_still_resumes_with_a_warning(tmp_path, capsys):
    spec = _crashed(tmp_path)
    store = RunStorage(spec.run_url)
    m = _manifest(spec, "000000000010")
    legacy = sign({k: v for k, v in m.items() if k not in ("binding", "signature")}, KEY.encode())
    store.commit_bytes(json.dumps(legacy).encode(), "states", "000000000010", "manifest.json")
    capsys.readouterr()
    assert run(with_overrides(spec, "faults=[]")).resumed_from == "000000000010"
    assert "signed before syncpoint bound signatures" in capsys.readouterr().err
