"""Every error type the project raises on purpose, in one place.

Why one module: an error type is part of the contract between layers (a worker raises
``LeaseLostError``, the driver classifies it; the CLI catches ``SpecError`` and exits 2), so it
must be importable from every layer without importing the module that happens to raise it.
This is a leaf: it imports nothing of the project but ``syncpoint.policies.decisions.redact``.

User errors (exit 2 or a failed run naming the field) derive from ``ValueError``; refusals of
a state or of the run directory derive from ``RuntimeError`` or ``Exception``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from syncpoint.policies.decisions.redact import redact_text

if TYPE_CHECKING:
    from syncpoint.policies.decisions.candidates import Candidate

MAX_MESSAGE_CHARS = 2000  # one error message, all problems together
MAX_PROBLEM_CHARS = 700  # one problem's line (echoed input is cut to 80 characters before that)


# ---------------------------------------------------------------- user input


class SpecError(ValueError):
    """Bad input: one paragraph per problem, naming the YAML path (and line) and the fix.

    Why capped and redacted here: every refusal of every entry point goes through this class, and
    a message quoting hostile input (ten thousand unknown keys, a megabyte-long value) or a storage
    URL with credentials must stay a short paragraph that is safe to print and log.
    """

    def __init__(self, source: str, problems: list[str], what: str = "invalid job spec") -> None:
        self.source, self.problems = _one_line(str(source), 200), _cap_problems(problems)
        super().__init__(f"{self.source}: {what}\n" + "\n".join(f"  - {p}" for p in self.problems))


def _one_line(text: str, limit: int) -> str:
    """Redacted, whitespace collapsed to single spaces, at most ``limit`` characters."""
    text = " ".join(redact_text(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cap_problems(problems: list[str]) -> list[str]:
    """Each problem one line of at most MAX_PROBLEM_CHARS, all together under MAX_MESSAGE_CHARS."""
    out: list[str] = []
    used = 200  # the source and headline
    for i, p in enumerate(problems):
        line = _one_line(p, MAX_PROBLEM_CHARS)
        if used + len(line) + 6 > MAX_MESSAGE_CHARS - 80:
            already = re.match(r"\.\.\. and (\d+) more problem", problems[-1])  # a count of unformatted ones
            more = len(problems) - i + (int(already.group(1)) - 1 if already else 0)
            out.append(f"... and {more} more problem(s); fix these first")
            break
        out.append(line)
        used += len(line) + 6
    return out


class UsageError(SpecError):
    """A bad command-line argument (``--set``, ``--policy-args``, ``RUN_DIR``, ...), not a bad job file:
    the same bounded, redacted paragraph and exit 2, headed "invalid argument"."""

    def __init__(self, argument: str, problems: list[str], what: str = "invalid argument") -> None:
        super().__init__(argument, problems, what)


class JobConfigError(ValueError):
    """A spec field that only fails on the workers (an import path, policy arguments): names the field."""


class TaskError(JobConfigError):
    """The task import path or its return value is unusable (a user error, not a preemption)."""


class CorpusError(JobConfigError):
    """A sharded corpus that cannot be read as given (no shard matches, a shard of another format, a
    cache too small for the shuffle window): names the shard or the field and the fix."""


class CorpusChanged(CorpusError):
    """A shard's bytes differ from the corpus index the run reads by (rewritten while the run read
    it): the samples at its positions would not be the ones the run's states were trained on."""


class ModelLoadError(ValueError):
    """A run's ``final/`` that ``syncpoint.load_model`` cannot rebuild the trained model from (none, one
    written before ``final/`` carried the task, weights that do not fit the task's model): names what
    and the fix."""


class TrainingDiverged(RuntimeError):
    """The loss stayed non-finite (``train.max_nonfinite_steps``), or a state to commit was: the run
    stops. Resumed exactly, it would diverge again at the same step: a refusal, never retried."""


class ElasticLayoutError(ValueError):
    """The world size cannot keep the global batch (a user error naming the sizes that work)."""


class DataLayoutError(ElasticLayoutError):
    """The dataset cannot fill one global micro-batch (a user error)."""


class ScheduleMismatch(ValueError):
    """A state's schedule position cannot continue under the live schedule (type or phase order changed)."""


# ---------------------------------------------------------------- states and the run directory


class NoResumableState(RuntimeError):
    """Candidates exist but none can be continued exactly: fail fast, listing every one."""

    def __init__(self, candidates: Sequence[Candidate], headline: str = "") -> None:
        self.candidates = candidates
        newest = next(iter(candidates), None)
        why = (
            f" The newest, {newest.name}, is {newest.verdict.value if newest.verdict else 'unclassified'}: "
            f"{newest.reason.rstrip('.')}."
            if newest is not None
            else ""
        )
        head = headline or (
            f"{len(candidates)} state(s) exist but none is resumable; refusing to start over on top "
            f"of them.{why} {_what_to_do(candidates)}"
        )
        super().__init__(head + "\n" + candidates_table(candidates))


def candidates_table(cands: Iterable[Candidate]) -> str:
    """Plain-text table of every candidate, newest first, and its verdict (for this error and
    ``syncpoint states``). Here, not beside ``Candidate``: this error prints it, and the candidates
    module already builds on this one."""
    rows = [("state", "micro-step", "verdict", "reason")]
    for c in sorted(cands, key=lambda c: c.sort_key, reverse=True):  # candidates.newest_first's order
        step = c.micro_step
        rows.append((c.name, "" if step is None else str(step), c.verdict.value if c.verdict else "?", c.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows)


def _what_to_do(candidates: Sequence[Candidate]) -> str:
    """The advice the candidates' verdicts call for: intact states that do not fit this run are not
    to be "fixed or removed"; the reasons below name what changed (or the key they need)."""
    verdicts = {c.verdict.value if c.verdict else "?" for c in candidates}
    fresh = "or set resume.policy: fresh with resume.on_existing: archive to start a new run."
    if verdicts and verdicts <= {"incompatible", "untrusted"}:
        return (
            "They are intact but do not fit this run: restore what each reason below names (the signing key, "
            f"for untrusted ones), {fresh}"
        )
    return f"Fix or remove the damaged (corrupt, torn, mid-cycle) states below, {fresh}"


class ResumeRefused(RuntimeError):
    """No state can be continued exactly (or the policy refused): fail before training a batch."""


class StateRefused(Exception):
    """Fetching or loading a chosen state found it unusable (checksum, unsafe path, disallowed
    pickle class, missing file): the loop marks it corrupt with this message and falls back."""


class StateMismatch(Exception):
    """A verified state that does not fit the live job (a buffer of another shape, names this model
    lacks): intact, so the candidate is incompatible, never corrupt; the loop falls back."""


class LeaseRefused(RuntimeError):
    """This submission may not write the run directory (someone else holds it)."""


class LeaseLostError(RuntimeError):
    """This run held the lease and lost it: it must stop before writing anything more."""


class RunDirectoryRefused(ResumeRefused):
    """The run directory cannot be used as it is (``states/`` is a symbolic link or no directory): no
    retry changes that, the user must; the message says how."""


# ---------------------------------------------------------------- storage entries


class UnsafeEntry(OSError):
    """An entry under the run directory that syncpoint never reads or writes through: a symbolic link,
    a FIFO, socket or device where a file or directory belongs, a name that leaves the directory.

    An ``OSError`` (storage, not the job's input), named in the message with what it is, so that
    discovery can make it a candidate's reason and the reader a refusal of the state."""


class OversizedEntry(UnsafeEntry):
    """A file larger than what it holds can be: its manifest size, or the cap of its kind of record."""


# syncpoint's refusals of the job itself (its spec, its task, selection, a lost lease, divergence):
# no retry can change them, so a failure with one of these is never retried (Ray Train's failure
# policy and the in-place supervisor both read this one list)
JOB_REFUSALS: tuple[type[BaseException], ...] = (
    JobConfigError,
    ResumeRefused,
    NoResumableState,
    LeaseLostError,
    TrainingDiverged,
)
