"""The twelve exact-resume holes found from outside (issue #13), each with the test that would
have caught it: finished runs, restarts inside a submission, changed data, precision and
optimizer, config-wins hyper-parameters, edited and incomplete states, random collate, unknown
checksums, non-finite metrics, elastic listings and the failure line."""

from __future__ import annotations

import json
import math
import os

import pytest

from syncpoint.policies.contracts.errors import NoResumableState, ResumeRefused
from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, TrainState
from syncpoint.policies.decisions.candidates import LiveJob, Verdict, classify
from syncpoint.policies.decisions.resume import BestMetric
from syncpoint.workers.integrity.digest import load_deepspeed_file
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.discovery import discover
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_in_process, run_spawned
from tests.helpers import (
    committed_steps,
    digest,
    linear_spec,
    run,
    run_until_crash,
    state_names,
    step_history,
    trainer_json,
    with_overrides,
)
from tests.meta import candidate_for, changed, commit_candidate, live, trainer_for


def _spec(tmp, *extra):
    # 10 micro-batches per epoch, accumulation 4: boundaries at 4, 8, 10, 14, 18, 20
    return linear_spec(
        tmp,
        "task.config.num_samples=10",
        "train.grad_accum=4",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *extra,
    )


def _events(spec, kind: str) -> list[dict]:
    return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == kind]


def _recommit(store: RunStorage, name: str, edit=None, drop: str | None = None, trainer: dict | None = None) -> None:
    """Rewrite a state's metadata and re-commit its manifest with matching checksums (an attacker
    or a buggy writer with storage access)."""
    from syncpoint.workers.integrity.checksum import checksum_bytes

    manifest = json.loads(store.read_bytes("states", name, "manifest.json", limit=MANIFEST_MAX_BYTES))
    if trainer is not None:
        data = store.write_json(trainer, "states", name, "trainer.json")
        manifest["files"]["trainer.json"] = {"size": len(data), "xxh3_128": checksum_bytes(data, "xxh3_128")}
    if drop:
        manifest["files"].pop(drop)
    if edit:
        edit(manifest)
    store.commit_bytes(json.dumps(manifest).encode(), "states", name, "manifest.json")


# ------------------------------------------------------------------ 1. a finished run stays finished


def test_max_steps_run_resubmitted_trains_nothing(tmp_path):
    spec = linear_spec(
        tmp_path,
        "task.config.num_samples=10",
        "train.grad_accum=4",
        "train.epochs=null",
        "train.max_steps=5",
        "checkpoint.save_every={value: 2, unit: optimizer_steps}",
    )
    first = run(spec)
    assert first.optimizer_step == 5
    before = (committed_steps(spec), digest(spec, first.final_state), len(_events(spec, "progress")))
    again = run(spec)  # a re-submitted job
    assert (again.optimizer_step, again.final_state, again.history) == (5, first.final_state, [])
    assert (committed_steps(spec), digest(spec, again.final_state), len(_events(spec, "progress"))) == before
    assert _events(spec, "finished")[-1]["optimizer_step"] == 5


@pytest.mark.parametrize("before", [None, "3"])
def test_an_in_process_run_leaves_local_rank_as_it_found_it(tmp_path, monkeypatch, before):
    """DeepSpeed needs ``LOCAL_RANK`` while the engine is built; left set after the run, it made an
    accelerate/HF Trainer started later in the same process wait for ``MASTER_ADDR`` (the CI failure of
    stop 24). The caller's value, or its absence, comes back."""
    if before is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", before)
    spec = linear_spec(tmp_path, "task.config.num_samples=8", "train.grad_accum=2", "train.epochs=1")
    assert run(spec).optimizer_step == 4  # 8 samples, micro-batch 1, accumulation 2
    assert os.environ.get("LOCAL_RANK") == before


def test_crash_right_after_the_final_commit_restarts_finished(tmp_path):
    ref = run(_spec(tmp_path / "ref", "train.max_steps=5", "train.epochs=null"))
    spec = _spec(
        tmp_path / "run",
        "train.max_steps=5",
        "train.epochs=null",
        f"faults=[{{at_micro_step: {ref.global_micro_step}, mode: raise}}]",
    )
    assert run_until_crash(spec)  # the final state is committed, then the process dies
    result = run(spec)
    assert result.history == [] and result.optimizer_step == 5
    assert digest(spec, result.final_state) == digest(_spec(tmp_path / "ref"), ref.final_state)


def test_lowered_max_steps_finishes_at_once_with_a_warning(tmp_path, capsys):
    spec = _spec(tmp_path)
    full = run(spec)
    lowered = with_overrides(spec, "train.max_steps=2")
    result = run(lowered)
    assert result.history == [] and result.optimizer_step == full.optimizer_step
    assert result.final_state == full.final_state
    assert "past train.max_steps 2" in capsys.readouterr().err


# ------------------------------------------------------------------ 2. a policy chooses where a submission starts


def _prepare_old_run(tmp_path):
    """A finished earlier submission with states at every optimizer step (4 .. 20)."""
    spec = _spec(tmp_path)
    run(spec)
    return spec


@pytest.mark.parametrize("policy", ["newest-resumable", "pinned", "best-metric", "fresh"])
def test_restart_inside_a_submission_continues_its_own_states(tmp_path, policy):
    reference = run(_spec(tmp_path / "ref", "train.epochs=3"))
    base = _prepare_old_run(tmp_path / "run")
    extra = {
        "pinned": ["resume.policy=pinned", "resume.policy_args={state: 4}"],
        "best-metric": ["resume.policy=best-metric", "resume.policy_args={metric: loss, mode: max}"],
        "fresh": ["resume.policy=fresh", "resume.on_existing=overwrite"],
    }.get(policy, [])
    # the new submission: one more epoch, retention keeps 2, a crash at micro-step 29 (after 28 committed)
    spec = with_overrides(
        base, "train.epochs=3", "checkpoint.keep_last=2", *extra, "faults=[{at_micro_step: 29, mode: raise}]"
    )
    with pytest.raises(BaseException) as crash:
        run_in_process(spec, print_progress=False, submission_id="submission-B")
    assert type(crash.value).__name__ == "InjectedCrash"
    kept = committed_steps(spec)
    assert kept == [24, 28], kept  # retention pruned where the submission started
    result = run_in_process(spec, print_progress=False, submission_id="submission-B")  # Ray's restart
    assert result.resumed_from == "000000000028"
    assert digest(spec, result.final_state) == digest(_spec(tmp_path / "ref", "train.epochs=3"), reference.final_state)


def test_a_new_submission_applies_the_policy_again(tmp_path):
    spec = _prepare_old_run(tmp_path)
    pinned = with_overrides(spec, "resume.policy=pinned", "resume.policy_args={state: 8}")
    assert run(pinned).resumed_from == "000000000008"


# ------------------------------------------------------------------ 3.-5. changed spec between attempts


def _crashed(tmp_path, *extra):
    spec = _spec(tmp_path, "faults=[{at_micro_step: 12, mode: raise}]", *extra)
    assert run_until_crash(spec)
    assert committed_steps(spec) == [4, 8, 10]
    return spec


@pytest.mark.parametrize(
    "change,field",
    [
        ("task.config.num_samples=11", "data.num_samples"),  # same micro-batches per epoch, another permutation
        ("train.seed=4", "train.seed"),
        ("train.optimizer.type=sgd", "train.optimizer.type"),
        ("deepspeed.precision=bf16", "deepspeed.precision"),
        ("train.grad_accum=2", "train.grad_accum"),
        ("train.micro_batch_size=2", "train.micro_batch_size"),
        ("deepspeed.zero_stage=2", "deepspeed.zero_stage"),
        ("train.scheduler.type=cosine", "resume.reset_schedule"),
    ],
)
def test_changes_that_cannot_continue_are_refused_at_selection(tmp_path, change, field):
    spec = _crashed(tmp_path)
    changed = with_overrides(spec, change, "faults=[]")
    with pytest.raises(ResumeRefused) as refused:
        run(changed)
    assert field in str(refused.value)
    decision = _events(spec, "resume_decision")[-1]
    assert decision["chosen"] is None and all(c["verdict"] == "incompatible" for c in decision["candidates"])
    assert len(_events(spec, "attempt_started")) == 1  # refused before the attempt trained or loaded anything


def test_reset_optimizer_keeps_weights_and_position_with_a_new_optimizer(tmp_path, capsys):
    spec = _crashed(tmp_path)
    changed = with_overrides(
        spec, "train.optimizer={type: sgd, momentum: 0.9}", "resume.reset_optimizer=true", "faults=[]"
    )
    result = run(changed)
    assert result.resumed_from == "000000000010" and result.optimizer_step == 6
    assert "optimizer state (moments) starts fresh" in capsys.readouterr().err
    saved = load_deepspeed_file(
        RunStorage(spec.run_url).read_bytes(
            "states", result.final_state, "engine/mp_rank_00_model_states.pt", limit=1 << 30
        )
    )
    group = saved["optimizer"]["param_groups"][0]
    assert group["momentum"] == 0.9 and "betas" not in group


def test_config_wins_for_every_optimizer_hyperparameter(tmp_path, capsys):
    spec = _crashed(tmp_path, "train.optimizer={type: adamw, weight_decay: 0.01}")
    changed = with_overrides(
        spec, "train.optimizer={type: adamw, weight_decay: 0.2, betas: [0.8, 0.9], eps: 1e-6}", "faults=[]"
    )
    result = run(changed)
    err = capsys.readouterr().err
    assert "weight_decay (param group 0): the state had 0.01, the spec says 0.2" in err
    assert "betas" in err and "eps" in err
    saved = load_deepspeed_file(
        RunStorage(spec.run_url).read_bytes(
            "states", result.final_state, "engine/mp_rank_00_model_states.pt", limit=1 << 30
        )
    )
    # the default no_decay split: weights decay, biases (the second group) do not, whatever weight_decay says
    got = [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in saved["optimizer"]["param_groups"]]
    assert got == [(0.2, (0.8, 0.9), 1e-6), (0.0, (0.8, 0.9), 1e-6)]


# ------------------------------------------------------------------ 6., 7., 9. edited, incomplete, unknown checksum


def _newest_verdict(spec) -> tuple[str, str, str]:
    run(with_overrides(spec, "faults=[]"))
    c = next(c for c in _events(spec, "resume_decision")[-1]["candidates"] if c["verdict"] != "resumable")
    return c["state"], c["verdict"], c["reason"]


def test_an_edited_micro_step_is_refused_and_both_listings_agree(tmp_path):
    spec = _crashed(tmp_path)
    store = RunStorage(spec.run_url)
    t = trainer_json(spec, "000000000010")
    t["global_micro_step"] = 11  # claims a mid-cycle micro-step; directory name unchanged
    _recommit(store, "000000000010", trainer=t)
    assert _newest_verdict(spec) == (
        "000000000010",
        "corrupt",
        "directory 000000000010 does not hold micro-step 11 (trainer.json global_micro_step)",
    )
    # renamed to match, the other position fields contradict it
    spec2 = _crashed(tmp_path / "b")
    store2 = RunStorage(spec2.run_url)
    t = trainer_json(spec2, "000000000010")
    t["global_micro_step"] = 11
    store2.rename_tree(("states", "000000000010"), ("states", "000000000011"))
    _recommit(store2, "000000000011", trainer=t, edit=lambda m: m.update(state="000000000011"))
    name, verdict, reason = _newest_verdict(spec2)
    assert (name, verdict) == ("000000000011", "corrupt") and "inconsistent" in reason


def test_trainer_json_changed_after_commit_is_refused_before_any_tensor(tmp_path):
    spec = _crashed(tmp_path)
    store = RunStorage(spec.run_url)
    t = trainer_json(spec, "000000000010")
    t["job_name"] = t["job_name"].upper()  # same size: only the checksum can tell
    store.write_json(t, "states", "000000000010", "trainer.json")  # manifest not re-committed
    name, verdict, reason = _newest_verdict(spec)
    assert (name, verdict) == ("000000000010", "corrupt") and "checksum" in reason


@pytest.mark.parametrize("drop", ["rng/rank_00000.safetensors", "engine/mp_rank_00_model_states.pt"])
def test_a_state_missing_a_required_file_is_incomplete(tmp_path, drop):
    spec = _crashed(tmp_path)
    store = RunStorage(spec.run_url)
    _recommit(store, "000000000010", drop=drop)
    name, verdict, reason = _newest_verdict(spec)
    assert (name, verdict) == ("000000000010", "corrupt") and "incomplete" in reason and drop in reason


def test_an_unknown_checksum_algorithm_is_refused_at_selection(tmp_path):
    spec = _crashed(tmp_path)
    store = RunStorage(spec.run_url)

    def md5(m):
        info = m["files"]["engine/mp_rank_00_model_states.pt"]
        info["md5"] = info.pop("xxh3_128")

    _recommit(store, "000000000010", edit=md5)
    name, verdict, reason = _newest_verdict(spec)
    assert (name, verdict) == ("000000000010", "corrupt") and "known checksum algorithm" in reason


@pytest.mark.parametrize("bad", ["engine/../../escape.pt", "/etc/passwd", "engine//x.pt", "engine\\x.pt"])
def test_manifest_paths_outside_the_state_are_refused_at_selection(tmp_path, bad):
    exp = live("j", 1, 1, 4, 10, 0, "f", 3, precision="fp32")
    c = candidate_for(8, exp)
    c.manifest["files"][bad] = {"size": 10, "xxh3_128": "ab" * 16}
    c.listing[bad] = 10
    assert classify(c, exp).verdict is Verdict.CORRUPT and repr(bad) in c.reason


# ------------------------------------------------------------------ 8. random collate with loader workers


@pytest.mark.parametrize("workers", [0, 1])
def test_random_collate_resumes_exactly(tmp_path, workers):
    """With a DataLoader worker the runs are spawned processes: forking a worker from a test process
    that has grown over hundreds of in-process runs can fail with ENOMEM (overcommit heuristics)."""
    task = ["task.path=tests.tasks:linear_random_collate", f"train.dataloader_workers={workers}"]
    ref_spec = _spec(tmp_path / "ref", *task)
    spec = _spec(tmp_path / "run", *task, f"faults=[{{at_micro_step: 13, mode: {'raise' if not workers else 'exit'}}}]")
    if workers:
        assert run_spawned(ref_spec, world_size=1) == [0]
        assert run_spawned(spec, world_size=1) == [17]  # the hard crash
        assert run_spawned(spec, world_size=1) == [0]
        ref_final, final = state_names(ref_spec)[-1], state_names(spec)[-1]
    else:
        ref_final = run(ref_spec).final_state
        assert run_until_crash(spec)
        final = run(spec).final_state
    ref_hist, hist = step_history(ref_spec), step_history(spec)
    assert {s: r.loss for s, r in hist.items()} == {s: r.loss for s, r in ref_hist.items()}
    assert digest(spec, final) == digest(ref_spec, ref_final)


# ------------------------------------------------------------------ 10., 11. metrics and listings


def test_best_metric_skips_non_finite_and_non_numeric_metrics():
    exp = live("j", 1, 1, 4, 10, 0, "f", 3)
    cands = [
        classify(candidate_for(s, exp, metrics={"loss": v}), exp)
        for s, v in ((4, 0.5), (8, float("nan")), (10, "low"), (14, float("-inf")))
    ]
    assert all(c.verdict is Verdict.RESUMABLE for c in cands)
    d = BestMetric("loss", "min").choose(cands[::-1], {})
    assert d.state == "000000000004" and "not finite" in d.reason and "not a number" in d.reason
    with pytest.raises(NoResumableState, match="finite metric"):
        BestMetric("loss", "min").choose(cands[1:], {})


def test_states_cli_survives_non_numeric_metrics_and_judges_elastic_runs_as_the_loop(tmp_path, capsys):
    from syncpoint.orchestrator.cli import main

    exp2 = live(
        "j",
        2,
        2,
        4,
        10,
        0,
        "f",
        3,
        elastic=True,
        global_batch=16,
        samples_per_epoch=40,
        precision="fp32",
        optimizer_type="adamw",
    )
    exp1 = changed(exp2, world_size=1, grad_accum=8, micro_batches_per_epoch=20)
    store = RunStorage(f"file://{tmp_path}/run")
    commit_candidate(store, candidate_for(8, exp2, metrics={"loss": "n/a"}))  # 8 micro-steps on 2 = 16 on 1
    commit_candidate(store, candidate_for(28, exp1))  # the newest: saved after shrinking to 1 worker
    assert main(["states", str(tmp_path / "run"), "--json", "--policy", "best-metric"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["verdict"] for c in out["candidates"]] == ["resumable", "resumable"]
    assert out["choice"]["state"] == "000000000028"


def test_the_live_jobs_identity_round_trips_through_the_trainer_record():
    exp = live(
        "j",
        2,
        2,
        4,
        10,
        1,
        "f",
        3,
        elastic=True,
        global_batch=16,
        samples_per_epoch=40,
        num_samples=41,
        precision="bf16",
        optimizer_type="sgd",
        scheduler_type="cosine",
        scheduler_phases=("linear_warmup", "cosine"),
        model_buffers=(("bn.running_mean", (16,), "float32"),),
        parameter_dtypes=("bfloat16", (("head.weight", "float32"),)),
    )
    t, identity = candidate_for(8, exp).trainer, exp.identity.model_dump()
    assert {k: v for k, v in identity.items() if k not in ("optimizer", "data", "scheduler")}.items() <= t.items()
    assert identity["optimizer"].items() <= t["optimizer"].items()  # the record adds the groups' running keys
    assert identity["data"].items() <= t["data"].items() and identity["scheduler"].items() <= t["scheduler"].items()
    assert LiveJob(TrainState.model_validate(t).identity()) == exp


def test_the_loops_own_states_are_resumable_by_the_clis_run_identity(tmp_path):
    from syncpoint.policies.decisions.elastic import layout
    from syncpoint.policies.decisions.live_job import live_job
    from syncpoint.workers.task import load_task
    from syncpoint.workers.training.engine import make_optimizer, model_buffers, model_fingerprint, parameter_dtypes
    from syncpoint.workers.training.param_groups import layout_of
    from syncpoint.workers.training.task_rngs import kind, of_task

    spec = _spec(tmp_path)
    run(spec)
    store = RunStorage(spec.run_url)
    newest = discover(store)[0]
    exp = LiveJob(TrainState.model_validate(newest.trainer).identity())
    assert all(classify(c, exp).verdict is Verdict.RESUMABLE for c in discover(store))
    assert exp.identity.data.num_samples == 10 and exp.identity.optimizer.type == "adamw"
    assert exp.identity.precision == "fp32"
    # the one constructor of the live job agrees with what its states read back
    task = load_task(spec.task.path, spec.task.config)
    t = spec.train
    groups = [g.record() for g in layout_of(make_optimizer(spec, task.model), task.model)]
    job = live_job(
        spec,
        layout(len(task.dataset), t.micro_batch_size, t.grad_accum, 1),
        model_fingerprint=model_fingerprint(task.model),
        num_samples=len(task.dataset),
        param_groups=groups,
        model_buffers=model_buffers(task.model),
        parameter_dtypes=parameter_dtypes(task.model),
        task_generators={p: kind(g) for p, g in of_task(task)[0].items()},
    )
    assert job == exp and len(groups) == 2  # the default no_decay split: weights, biases


# ------------------------------------------------------------------ 12. the failure line says why


def _ray_failure(exc: BaseException) -> BaseException:
    """Wrap a real worker exception exactly as Ray Train v2 hands it to the driver."""
    import traceback

    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import WorkerGroupError

    tb = "".join(traceback.format_exception(exc))
    return WorkerGroupError(f"[Rank 0 Error Snippet]:\n{tb}", {0: UserExceptionWithTraceback(exc, tb)})


def _failure_of(spec) -> BaseException:
    try:
        run(spec)
    except Exception as e:  # noqa: BLE001 - whatever the run raised is the failure under test
        return e
    raise AssertionError("the run did not fail")


def test_the_failure_line_carries_the_reason_for_each_refusal_kind(tmp_path):
    from syncpoint.orchestrator.failure_report import failure_report

    spec = _crashed(tmp_path)
    kinds = {
        "incompatible": (with_overrides(spec, "train.seed=9", "faults=[]"), "train.seed"),
        "pinned missing": (
            with_overrides(spec, "resume.policy=pinned", "resume.policy_args={state: 99}", "faults=[]"),
            "pinned state 99 does not exist",
        ),
        "policy args": (
            with_overrides(spec, "resume.policy=pinned", "resume.policy_args={nope: 1}", "faults=[]"),
            "resume.policy / resume.policy_args",
        ),
        "user error": (
            linear_spec(
                tmp_path / "u", "task.path=tests.tasks:failing_loss", "task.config={num_samples: 8, fail_at: 3}"
            ),
            "ValueError: bad batch at call 3",
        ),
    }
    for kind, (s, expected) in kinds.items():
        reason, details = failure_report(_ray_failure(_failure_of(s)))
        assert expected in reason, (kind, reason)
        assert "ResumeRefused(" not in reason and "\n" not in reason


def test_refusal_headline_names_the_newest_candidates_reason():
    exp = live("j", 1, 1, 4, 10, 0, "f", 3)
    other = changed(exp, seed=4)
    cands = [classify(candidate_for(s, other), exp) for s in (10, 8)]
    from syncpoint.policies.decisions.resume import NewestResumable

    with pytest.raises(NoResumableState) as e:
        NewestResumable().choose(cands, {})
    assert "The newest, 000000000010, is incompatible: sampler seed differs" in str(e.value).splitlines()[0]


def test_finite_metric_rules():
    from syncpoint.policies.decisions.candidates import finite_metric

    def state(**metrics):
        return TrainState.model_validate(trainer_for(8, live("j", 1, 1, 4, 10, 0, "f", 3), metrics=metrics))

    assert finite_metric(state(m=1), "m") == (1.0, "")
    assert finite_metric(state(m=True), "m")[0] is None
    assert finite_metric(state(m=math.inf), "m")[0] is None
    assert finite_metric(state(), "m")[0] is None
    assert finite_metric(None, "m")[0] is None


def test_non_state_names_are_not_candidates(tmp_path):
    spec = _crashed(tmp_path)
    store = RunStorage(spec.run_url)
    store.write_bytes(b"notes", "states", "README.txt")
    store.write_bytes(b"x", "states", "notes", "a.txt")
    assert [c.name for c in discover(store)] == ["000000000010", "000000000008", "000000000004"]
    assert run(with_overrides(spec, "faults=[]")).resumed_from == "000000000010"


def test_retention_keeps_the_submissions_own_newest_state_behind_newer_old_ones(tmp_path):
    base = _prepare_old_run(tmp_path)  # states 4 .. 20 from an earlier submission
    spec = with_overrides(
        base,
        "resume.policy=pinned",
        "resume.policy_args={state: 4}",
        "checkpoint.keep_last=2",
        "faults=[{at_micro_step: 9, mode: raise}]",
    )
    with pytest.raises(BaseException) as crash:
        run_in_process(spec, print_progress=False, submission_id="submission-C")
    assert type(crash.value).__name__ == "InjectedCrash"
    assert 8 in committed_steps(spec)  # 18 and 20 are newer, yet the submission's own state stays
    result = run_in_process(spec, print_progress=False, submission_id="submission-C")
    assert result.resumed_from == "000000000008"


def test_the_drill_report_lists_every_interruption_it_caused(tmp_path):
    """A drill whose interrupted run shows fewer restarts than injected interruptions still prints a
    row for each interruption (and fails), instead of silently dropping it."""
    from syncpoint.orchestrator.drill import compare

    ref, spec = _spec(tmp_path / "ref"), _spec(tmp_path / "run")
    run(ref)
    run(spec)  # no restart happened at all
    report = compare(ref, spec, 0, 0, [5, 13], ["crash", "crash"])
    rows = [ln for ln in report.table.splitlines() if "no restart seen" in ln]
    assert len(rows) == 2 and "5" in rows[0] and "13" in rows[1]
    assert not report.ok
