"""Resume policies: choose the state a run continues from, given classified candidates.

A policy is any object with ``choose(candidates, spec) -> Decision``. ``candidates`` is a
newest-first sequence (possibly read lazily as it is walked, so a policy that stops early reads
little); each item carries its verdict and reason. It sees metadata and
verdicts only (no I/O), so it is a pure function of what discovery found. The loader refuses a
decision that names an unsafe candidate, so a custom policy can never make a run resume from a
mid-cycle, torn, corrupt or incompatible state. Users plug their own in with
``resume.policy: "package.module:Class"`` and ``resume.policy_args: {...}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import NoResumableState
from syncpoint.policies.contracts.import_path import load_class
from syncpoint.policies.decisions.candidates import Candidate, Verdict, finite_metric


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the state to resume (a candidate's name) or a fresh start, and why (shown
    by ``syncpoint states`` and the run's first log line)."""

    state: str | None  # candidate name, or None for a fresh start
    reason: str


class ResumePolicy(Protocol):
    """Where a submission starts: the built-in policies and any class ``resume.policy`` names.

    A policy decides from metadata only (the brief's rule 3): it never reads a tensor, and whatever
    it picks must be a candidate whose verdict is ``Verdict.RESUMABLE`` (``enforce_safe`` refuses
    anything else after it returns).
    """

    def choose(self, candidates: Sequence[Candidate], spec: JSONObject) -> Decision:
        """Pick a state, or a fresh start.

        Args:
            candidates: every state directory of the run, newest first, each already classified
                (``verdict``, ``reason``) with its typed records (``state``, ``record``).
            spec: the live job spec as JSON (``JobSpec.model_dump(mode="json")``): plain data, so a
                custom policy reads the fields it needs without importing syncpoint's models.

        Returns:
            The decision; raise ``NoResumableState`` to fail the run with a reason instead.
        """
        ...


class NoArgs(BaseModel):
    """A policy's ``resume.policy_args``, as its own model: a built-in declares ``Args`` (this one
    for a policy that takes none), and the driver checks the spec's arguments against it before
    anything starts (``policy_args_problem``); a custom policy may declare one too."""

    model_config = ConfigDict(extra="forbid", strict=True)


class NewestResumable:
    """Default: the newest resumable state; fresh when the run directory has no states.

    Walks the candidates in the order given (newest first) and stops at the first resumable one,
    so with lazily read candidates it touches O(1) manifests.
    """

    Args: ClassVar[type[BaseModel]] = NoArgs
    starts_over: ClassVar[bool] = False

    def choose(self, candidates: Sequence[Candidate], spec: JSONObject) -> Decision:
        if not candidates:
            return Decision(None, "no states yet: fresh start")
        skipped: list[str] = []
        for c in candidates:
            if c.verdict is Verdict.RESUMABLE:
                why = f"newest resumable state ({c.reason})"
                if skipped:
                    why += f"; skipped newer unsafe: {', '.join(skipped)}"
                return Decision(c.name, why)
            skipped.append(c.name)
        if all(c.verdict is Verdict.TORN for c in candidates):
            # Only saves that never committed (a crash during the first save): no progress exists to
            # protect, so refusing would strand the run for nothing. Retention removes the debris later.
            return Decision(None, f"only torn states ({', '.join(skipped)}): no save ever committed; fresh start")
        raise NoResumableState(list(candidates))


class PinnedArgs(NoArgs):
    """``pinned``: the state, by its micro-step (``120``) or its name (``"000000000120"``)."""

    state: str | int


class Pinned:
    """A given micro-step or state name; fails clearly if that state is not resumable."""

    Args: ClassVar[type[BaseModel]] = PinnedArgs
    starts_over: ClassVar[bool] = False

    def __init__(self, state: str | int) -> None:
        self.state = str(state)

    def choose(self, candidates: Sequence[Candidate], spec: JSONObject) -> Decision:
        for c in candidates:
            if c.name == self.state or (self.state.isdigit() and c.micro_step == int(self.state)):
                if c.verdict is Verdict.RESUMABLE:
                    return Decision(c.name, f"pinned to {self.state}")
                verdict = c.verdict.value if c.verdict else "unclassified"
                raise NoResumableState(candidates, f"pinned state {self.state} is {verdict}: {c.reason}.")
        raise NoResumableState(candidates, f"pinned state {self.state} does not exist.")


class Fresh:
    """Ignore existing states (the driver archives or refuses a non-empty run directory).

    ``starts_over``: the one policy whose submission empties the run directory first (archive or
    overwrite) and never continues another submission's states; its restarts continue its own."""

    Args: ClassVar[type[BaseModel]] = NoArgs
    starts_over: ClassVar[bool] = True

    def choose(self, candidates: Sequence[Candidate], spec: JSONObject) -> Decision:
        return Decision(None, "policy fresh: start from scratch")


class BestMetricArgs(NoArgs):
    """``best-metric``: which ``trainer.json`` metric, and whether lower or higher is better."""

    metric: str = "loss"
    mode: Literal["min", "max"] = "min"


class BestMetric:
    """The resumable state with the best recorded metric (``trainer.json`` ``metrics``)."""

    Args: ClassVar[type[BaseModel]] = BestMetricArgs
    starts_over: ClassVar[bool] = False

    def __init__(self, metric: str = "loss", mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError("best-metric mode must be 'min' or 'max'")
        self.metric, self.mode = metric, mode

    def choose(self, candidates: Sequence[Candidate], spec: JSONObject) -> Decision:
        scored: list[tuple[float, Candidate]] = []
        skipped: list[str] = []
        for c in candidates:
            if c.verdict is not Verdict.RESUMABLE:
                continue
            value, why = finite_metric(c.parse().state, self.metric)
            if value is None:
                skipped.append(f"{c.name} ({why})")
            else:
                scored.append((value, c))
        if not scored:
            if not candidates:
                return Decision(None, "no states yet: fresh start")
            extra = f" Skipped: {'; '.join(skipped[:5])}." if skipped else ""
            raise NoResumableState(candidates, f"no resumable state records a finite metric {self.metric!r}.{extra}")
        pick = (min if self.mode == "min" else max)(scored, key=lambda sc: (sc[0], sc[1].sort_key))
        why = f"best {self.metric} ({self.mode}) = {pick[0]:.6g}"
        if skipped:
            why += f"; skipped {', '.join(skipped[:5])}"
        return Decision(pick[1].name, why)


class ContinueSubmission:
    """One rule for every policy: a policy chooses where a *submission* starts; a restart inside
    the same submission continues from the newest state that submission itself committed.

    Why: re-applying ``pinned`` (or ``best-metric``, or a custom policy) on every Ray restart would
    recompute everything since the pin, or fail once retention pruned it. States carry the
    submission that wrote them (``trainer.json`` ``submission``); when this submission committed
    nothing resumable yet, the start policy decides again, exactly as it did at the start.
    """

    def __init__(self, submission: str, start: ResumePolicy) -> None:
        self.submission, self.start = submission, start

    def choose(self, candidates: Sequence[Candidate], spec: JSONObject) -> Decision:
        for c in candidates:
            if c.verdict is Verdict.RESUMABLE and _submission_of(c) == self.submission:
                return Decision(c.name, f"restart of this submission: the newest state it committed ({c.reason})")
        decision = self.start.choose(candidates, spec)
        return Decision(decision.state, f"restart of this submission, nothing committed yet: {decision.reason}")


def _submission_of(c: Candidate) -> str | None:
    state = c.parse().state
    return state.submission if state is not None else None


# The built-in policies, by the word the spec names them with (``BUILTIN_POLICIES`` in the spec is
# the same list, which a test keeps equal): what each takes (``Args``) and whether it starts over
# (``starts_over``) are asked of the class here, never of its name elsewhere.
BUILTIN: dict[str, type] = {
    "newest-resumable": NewestResumable,
    "pinned": Pinned,
    "fresh": Fresh,
    "best-metric": BestMetric,
}


def starts_over(name: str) -> bool:
    """Whether the policy ``name`` starts a submission over (empties the run directory first)."""
    return bool(getattr(BUILTIN.get(name), "starts_over", False))


def policy_args_problem(name: str, args: Mapping[str, object], cls: type | None = None) -> str | None:
    """What is wrong with ``args`` for the policy ``name`` (its class ``cls``, else a built-in's), by
    its ``Args`` model: one line naming the argument, or None. A policy without ``Args`` is not
    checked here (its constructor is the check)."""
    model = getattr(cls or BUILTIN.get(name), "Args", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    try:
        model.model_validate(args)
    except ValidationError as e:
        wrong = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(the arguments)"
            what = "is not an argument it takes" if err["type"] == "extra_forbidden" else err["msg"].lower()
            wrong.append(f"{where} {what}")
        takes = ", ".join(model.model_fields) or "no arguments"
        return f"resume.policy_args for {name}: {'; '.join(wrong)} (it takes: {takes})"
    return None


def make_policy(name: str, args: Mapping[str, object] | None = None) -> ResumePolicy:
    """A built-in policy by name, or a custom one by import path: a class with a ``choose`` method,
    checked before it is instantiated with ``args`` (``ValueError`` names what the path is instead,
    or which argument its ``Args`` model refuses)."""
    cls = BUILTIN.get(name) or load_class(name, "choose")
    problem = policy_args_problem(name, args or {}, cls)
    if problem:
        raise ValueError(problem)
    policy: ResumePolicy = cls(**(args or {}))
    return policy


def enforce_safe(decision: Decision, candidates: Sequence[Candidate]) -> Decision:
    """The loader's guard: a decision naming an unsafe or unknown candidate is refused."""
    if decision.state is None:
        return decision
    c = next((x for x in candidates if x.name == decision.state), None)
    if c is None:
        raise NoResumableState(candidates, f"the resume policy chose {decision.state!r}, which does not exist.")
    if c.verdict is not Verdict.RESUMABLE:
        verdict = c.verdict.value if c.verdict else "unclassified"
        raise NoResumableState(
            candidates, f"the resume policy chose {c.name}, which is {verdict} ({c.reason}); refused."
        )
    return decision
