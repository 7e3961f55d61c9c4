"""Policy unit tests on plain metadata: no storage, no engine, no Ray."""

from __future__ import annotations

import pytest

from syncpoint.policies.contracts.errors import NoResumableState
from syncpoint.policies.decisions.candidates import Candidate, Verdict, classify, newest_first
from syncpoint.policies.decisions.resume import BestMetric, Fresh, NewestResumable, Pinned, enforce_safe, make_policy
from syncpoint.policies.decisions.retention import plan_retention
from syncpoint.policies.decisions.save_triggers import (
    EveryMicroSteps,
    EveryOptimizerSteps,
    EverySeconds,
    PendingSave,
    Tick,
)
from tests.meta import candidate_for, changed, commit_candidate, live, trainer_for

EXP = live(
    job_identity="j",
    world_size=2,
    micro_batch_size=4,
    grad_accum=4,
    micro_batches_per_epoch=10,
    zero_stage=2,
    model_fingerprint="f",
    seed=1,
)


def trainer(step: int, **kw) -> dict:
    return trainer_for(step, EXP, **kw)


def cand(step: int, *, manifest: bool = True, **kw) -> Candidate:
    return classify(candidate_for(step, EXP, manifest=manifest, **kw), EXP)


def test_classification_reasons():
    assert cand(8).verdict is Verdict.RESUMABLE
    assert cand(10).verdict is Verdict.RESUMABLE  # epoch end flushes a short cycle
    c = cand(12)
    assert c.verdict is Verdict.MID_CYCLE and "position 2" in c.reason
    assert cand(13, manifest=False).verdict is Verdict.TORN
    assert cand(8, job_identity="other").verdict is Verdict.INCOMPATIBLE
    c = classify(candidate_for(8, changed(EXP, world_size=4)), EXP)
    assert c.verdict is Verdict.INCOMPATIBLE and "world size" in c.reason
    c = cand(8, world_size=4)  # one field edited alone contradicts the others
    assert c.verdict is Verdict.CORRUPT and "inconsistent" in c.reason
    c = cand(8, schema_version=99)
    assert c.verdict is Verdict.INCOMPATIBLE and "newer" in c.reason
    wrong_size = Candidate(
        name="x", trainer=trainer(8), manifest={"files": {"trainer.json": {"size": 11}}}, listing={"trainer.json": 10}
    )
    assert classify(wrong_size, EXP).verdict is Verdict.CORRUPT
    bad = classify(Candidate(name="y", manifest_error="not JSON", listing={"manifest.json": 3}), EXP)
    assert bad.verdict is Verdict.CORRUPT


def test_mid_cycle_is_recomputed_not_trusted():
    # a flag claiming it is a boundary does not matter: position 2 with accumulation 4 is mid-cycle
    assert cand(12, is_boundary=True).verdict is Verdict.MID_CYCLE


def test_newest_resumable_skips_unsafe_and_fails_listing_all():
    cs = newest_first([cand(4), cand(8), cand(12), cand(13, manifest=False)])  # policies get newest first
    d = NewestResumable().choose(cs, {})
    assert d.state == "000000000008" and "000000000012" in d.reason
    assert NewestResumable().choose([], {}).state is None
    only_torn = NewestResumable().choose([cand(13, manifest=False), cand(9, manifest=False)], {})
    assert only_torn.state is None and "no save ever committed" in only_torn.reason  # nothing to protect: fresh
    with pytest.raises(NoResumableState) as e:
        NewestResumable().choose([cand(13, manifest=False), cand(12)], {})
    assert "000000000012" in str(e.value) and "000000000013" in str(e.value) and "mid-cycle" in str(e.value)


def test_pinned_best_metric_fresh_and_custom():
    cs = [cand(4, metrics={"loss": 0.5}), cand(8, metrics={"loss": 0.7}), cand(12)]
    assert Pinned(4).choose(cs, {}).state == "000000000004"
    with pytest.raises(NoResumableState, match="mid-cycle"):
        Pinned("000000000012").choose(cs, {})
    with pytest.raises(NoResumableState, match="does not exist"):
        Pinned(99).choose(cs, {})
    assert BestMetric("loss", "min").choose(cs, {}).state == "000000000004"
    assert BestMetric("loss", "max").choose(cs, {}).state == "000000000008"
    assert Fresh().choose(cs, {}).state is None
    custom = make_policy("tests.tasks:LastStateOnly", {"name": "000000000012"})
    with pytest.raises(NoResumableState, match="refused"):
        enforce_safe(custom.choose(cs, {}), cs)  # the loader refuses an unsafe choice
    with pytest.raises(ValueError, match="no attribute"):
        make_policy("tests.tasks:Nope")


def test_retention_never_strands_and_unsafe_never_counts():
    cs = [cand(4), cand(8), cand(12), cand(13, manifest=False), cand(2, manifest=False)]
    plan = plan_retention(cs, keep_last=1)
    assert "000000000008" in plan.keep and "000000000004" in plan.delete
    assert "000000000012" in plan.keep and any("000000000012" in r for r in plan.reported)
    assert "000000000013" in plan.keep  # newer torn: maybe a save in flight
    assert "000000000002" in plan.delete  # older torn: debris
    assert plan_retention(cs, keep_last=0).delete == ["000000000002"]  # 0 keeps every resumable
    pruned = plan_retention(cs, keep_last=1, prune_unsafe=True)
    assert "000000000012" not in pruned.delete  # newer than the newest resumable: never pruned
    only_unsafe = [cand(12), cand(13, manifest=False)]
    assert plan_retention(only_unsafe, keep_last=1).delete == []


def test_save_triggers_and_pending_latch():
    assert [s for s in range(1, 13) if EveryMicroSteps(3).wants_save(Tick(s, 0, False, 0))] == [3, 6, 9, 12]
    assert not EveryOptimizerSteps(2).wants_save(Tick(8, 2, False, 0))
    assert EveryOptimizerSteps(2).wants_save(Tick(8, 2, True, 0))
    assert EverySeconds(5).wants_save(Tick(1, 0, False, 6.0))
    p = PendingSave()
    p.request("interval")
    p.request("interval")
    p.request("preemption")
    assert p.pending and p.take() == ["interval", "preemption"] and not p.pending


def test_lazy_selection_reads_only_what_it_walks(tmp_path):
    from syncpoint.workers.state.discovery import discover_lazy
    from syncpoint.workers.storage import RunStorage

    store = RunStorage(str(tmp_path))
    for step in (4, 8, 12):
        commit_candidate(store, candidate_for(step, EXP))
    lazy = discover_lazy(store, EXP)
    assert len(lazy) == 3 and lazy.inspected() == []
    d = NewestResumable().choose(lazy, {})
    assert d.state == "000000000008"  # 12 is mid-cycle
    assert [c.name for c in lazy.inspected()] == ["000000000012", "000000000008"]  # 4 never read


def test_a_builtin_policys_arguments_are_checked_by_its_own_model():
    """Each built-in declares ``Args``; what it does not take is named with what it does."""
    from syncpoint.policies.decisions.resume import policy_args_problem

    assert policy_args_problem("pinned", {"state": 120}) is None
    assert policy_args_problem("pinned", {"state": "000000000120"}) is None
    missing = policy_args_problem("pinned", {})
    assert missing is not None and "resume.policy_args for pinned: state field required" in missing
    typo = policy_args_problem("pinned", {"stat": 120})
    assert typo is not None and "stat is not an argument it takes" in typo and "(it takes: state)" in typo
    mode = policy_args_problem("best-metric", {"mode": "low"})
    assert mode is not None and "mode input should be 'min' or 'max'" in mode
    assert policy_args_problem("best-metric", {}) is None
    extra = policy_args_problem("newest-resumable", {"state": 1})
    assert extra is not None and "(it takes: no arguments)" in extra
    assert policy_args_problem("mypkg.policies:Mine", {"anything": 1}) is None  # a custom class: its constructor
    with pytest.raises(ValueError, match="stat is not an argument it takes"):
        make_policy("pinned", {"stat": 120})


def test_a_custom_policy_may_declare_its_arguments_too():
    from pydantic import BaseModel

    from syncpoint.policies.decisions.resume import policy_args_problem

    class KeepArgs(BaseModel):
        keep: int

    class Mine:
        Args = KeepArgs

        def __init__(self, keep: int) -> None:
            self.keep = keep

    assert policy_args_problem("mypkg:Mine", {"keep": 2}, Mine) is None
    assert "keep" in (policy_args_problem("mypkg:Mine", {"keep": "two"}, Mine) or "")


def test_the_builtins_are_one_table_and_only_fresh_starts_over():
    from syncpoint.policies.contracts.spec import BUILTIN_POLICIES
    from syncpoint.policies.decisions.resume import BUILTIN, starts_over

    assert set(BUILTIN) == set(BUILTIN_POLICIES)
    assert [n for n in BUILTIN if starts_over(n)] == ["fresh"]
    assert not starts_over("mypkg.policies:Fresh")
