"""Where a run with no state of its own to resume begins: over (``resume.policy: fresh`` archives or
deletes what a previous submission left), finished already, or from another run's or a pretrained
model's weights (``resume.init_from``).

Why apart from the negotiation: these decide what the run directory and the first weights are before
any candidate is chosen, each with its own refusals; the negotiation picks among committed states.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from syncpoint.policies.contracts.errors import (
    NoResumableState,
    ResumeRefused,
)
from syncpoint.policies.contracts.journal import InitFromResolved
from syncpoint.policies.contracts.state_format import (
    STATES_DIR,
)
from syncpoint.policies.decisions.compatibility import init_from_problem
from syncpoint.policies.decisions.redact import redact_url
from syncpoint.policies.decisions.resume import (
    starts_over,
)
from syncpoint.workers.integrity.signing import load_key
from syncpoint.workers.state.discovery import discover, read_candidate
from syncpoint.workers.state.pretrained import PretrainedInit
from syncpoint.workers.state.reader import fetch_state, load_into_engine
from syncpoint.workers.state.resume_choice import ResumeChoice, manifest_sha256, node_peers
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.training.attempt import Attempt
from syncpoint.workers.training.position import RunLength, TrainingPosition

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from syncpoint.policies.decisions.candidates import Candidate


def already_finished(attempt: Attempt, state: str | None, at: TrainingPosition, run_length: RunLength) -> bool:
    """A state at or past the run's end finishes at once (export and finish only), whatever unit
    ended it: re-submitting a finished run, or restarting after its final commit, trains nothing."""
    done = run_length.reached(at)
    max_steps, step = attempt.spec.train.max_steps, at.optimizer_step
    if done and state is not None:
        if max_steps is not None and step > max_steps:
            attempt.warn(
                f"state {state} is at optimizer step {step}, past train.max_steps {max_steps}: the run "
                f"finishes at once and its final model is that state's weights (step {step})"
            )
        attempt.say(f"state {state} already reached the end of the run (optimizer step {step}); nothing left to train")
    return done


def clear_for_fresh(attempt: Attempt) -> None:
    """``resume.policy: fresh`` over existing states: refuse, archive them, or delete them."""
    storage, mode = attempt.storage, attempt.spec.resume.on_existing
    if mode == "refuse":
        raise NoResumableState(
            [],
            (
                f"resume.policy fresh, but {redact_url(storage.url)}/states already holds states; set "
                "resume.on_existing: "
                "archive (move them to archive/) or overwrite (delete them), or use another run name."
            ),
        )
    if mode == "archive":
        archived = f"{STATES_DIR}-{int(time.time())}"
        storage.rename_tree((STATES_DIR,), ("archive", archived))
        attempt.say(f"resume.policy fresh: the run starts over; its earlier states are in archive/{archived}")
    else:
        storage.delete_tree(STATES_DIR)


def maybe_init_from(attempt: Attempt, engine: DeepSpeedEngine) -> None:
    """Fine-tune: take weights (optionally optimizer state) from another run; never its position.

    Rank 0 resolves the source state once per run and every rank loads what it broadcast: the
    first resolution is recorded in the run's journal (``InitFromResolved``: the state and a
    sha256 of its manifest), and every later attempt before the run's own first commit takes that
    same state, refused if it changed or went away, instead of whatever the source run committed
    since (two attempts of one fine-tune must not start from two different weights)."""
    spec = attempt.spec
    url = spec.resume.init_from
    if not url:
        return
    if attempt.pretrained is not None:
        _take_pretrained(attempt, attempt.pretrained)
        return
    base, sep, _ = url.rstrip("/").rpartition("/states/")
    source = RunStorage(base if sep else url)
    key = load_key(spec.resume.init_from_signing_key_env, "resume.init_from_signing_key_env") or load_key(
        spec.checkpoint.signing_key_env
    )
    choice = ResumeChoice()
    if attempt.rank == 0:
        try:
            choice = _resolve_init_from(attempt, source, key)
        except ResumeRefused as e:
            choice = ResumeChoice(error=str(e))
    choice = choice.broadcast()
    if choice.error is not None:
        raise ResumeRefused(choice.error)
    candidate = choice.candidate()
    name = candidate.name
    fetched = fetch_state(source, candidate, attempt.rank, want_rng=False, peers=node_peers())
    try:
        load_into_engine(engine, fetched, module_only=not spec.resume.init_optimizer)
    finally:
        fetched.cleanup()
    attempt.say(
        f"init_from {redact_url(source.url)}/states/{name}: weights imported; schedule, RNG and data start fresh"
    )


def _take_pretrained(attempt: Attempt, pretrained: PretrainedInit) -> None:
    """The pretrained directory loaded before DeepSpeed (``syncpoint.workers.state.pretrained``) is what
    this attempt starts from: refused when it could not be read or does not fit, when the spec also
    asks for optimizer state (it has none), or, on a later attempt, when its bytes changed since the
    run first took it (rank 0 checks the journal; every rank raises the same refusal)."""
    shown = redact_url(pretrained.url)
    error = pretrained.error
    if error is None and attempt.spec.resume.init_optimizer:
        error = (
            f"resume.init_optimizer: {shown} is a pretrained model directory, which holds weights only; set "
            "resume.init_optimizer: false, or init_from a run's state"
        )
    if error is None and attempt.rank == 0 and attempt.events is not None and pretrained.sha256:
        over = starts_over(attempt.spec.resume.policy) and not attempt.restart
        recorded = None if over else attempt.events.journal().init_from(shown)
        if recorded is None:
            attempt.events.emit(
                InitFromResolved(
                    attempt=attempt.number,
                    init_from=shown,
                    source_state="pretrained",
                    manifest_sha256=pretrained.sha256,
                )
            )
        elif recorded.manifest_sha256 != pretrained.sha256:
            error = (
                f"resume.init_from: {shown}, the pretrained model this run took at attempt {recorded.attempt}, changed "
                f"since (sha256 {recorded.manifest_sha256[:16]}... then, {pretrained.sha256[:16]}... now). The run's "
                "first attempts started from the old weights; restore them, or start the fine-tune again as a new run"
            )
    error = ResumeChoice(error=error).broadcast().error
    if error is not None:
        raise ResumeRefused(error)
    attempt.say(
        f"init_from {shown}: pretrained weights loaded (sha256 {str(pretrained.sha256)[:16]}...); schedule, RNG "
        "and data start fresh"
    )


def _committed_and_trusted(candidate: Candidate, recorded: InitFromResolved | None, where: str, shown: str) -> str:
    """The source state's manifest sha256, once it is committed and trusted (``ResumeRefused`` saying
    which it is not, and when this run took it before, that it is gone)."""
    if candidate.manifest is None:
        if recorded is not None:
            raise ResumeRefused(
                f"resume.init_from: {where}, the source state this run took at attempt {recorded.attempt}, is gone "
                "(no manifest.json). Restore it, or start the fine-tune again as a new run (another name) to "
                "take another source state"
            )
        raise ResumeRefused(f"resume.init_from: {shown} is not a committed state (no manifest.json)")
    if candidate.trust_error:
        raise ResumeRefused(
            f"resume.init_from: {where} is untrusted: {candidate.trust_error}. "
            "Give the source run's key with resume.init_from_signing_key_env"
        )
    return manifest_sha256(candidate.manifest)


def _resolve_init_from(attempt: Attempt, source: RunStorage, key: bytes | None) -> ResumeChoice:
    """Rank 0: the source state's name and metadata, checked from metadata alone; the run's first
    resolution is recorded, a later attempt reuses it (``ResumeRefused`` when it cannot)."""
    spec = attempt.spec
    url = spec.resume.init_from or ""
    shown = redact_url(url)
    _, sep, name = url.rstrip("/").rpartition("/states/")
    # a new submission with resume.policy fresh starts over: it resolves the source again
    over = starts_over(spec.resume.policy) and not attempt.restart
    recorded = attempt.events.journal().init_from(shown) if attempt.events is not None and not over else None
    if recorded is not None:
        name = recorded.source_state
    elif not sep:
        candidates = discover(source, signing_key=key)
        name = next((c.name for c in candidates if c.manifest and not c.trust_error), "")
        if not name:
            raise ResumeRefused(f"resume.init_from: {shown} holds no committed{' and trusted' if key else ''} state")
    candidate = read_candidate(source, name, key)
    where = f"{redact_url(source.url)}/states/{name}"
    digest = _committed_and_trusted(candidate, recorded, where, shown)
    if recorded is not None and digest != recorded.manifest_sha256:
        raise ResumeRefused(
            f"resume.init_from: {where}, the source state this run took at attempt {recorded.attempt}, changed since "
            f"(its manifest's sha256 was {recorded.manifest_sha256[:16]}..., now {digest[:16]}...). The run's "
            "first attempts started from the old bytes; restore them, or start the fine-tune again as a new run"
        )
    problem = init_from_problem(candidate, attempt.live, spec.resume.init_optimizer)
    if problem:
        raise ResumeRefused(f"resume.init_from: {where} cannot be taken: {problem}")
    if recorded is None and attempt.events is not None:
        attempt.events.emit(
            InitFromResolved(attempt=attempt.number, init_from=shown, source_state=name, manifest_sha256=digest)
        )
    elif recorded is not None:
        attempt.say(f"init_from: the source state this run took at attempt {recorded.attempt} ({name}), unchanged")
    return ResumeChoice.of(name, candidate, "")
