"""Why a failed run failed, in one line: the failing code's own exception out of Ray's wrappers,
and which rank's says why when several failed. The one rule for a failed run's last line and for
the failure policy's message of each failed rank (``failure_policy``, ``ray_runner``).
"""

from __future__ import annotations

from syncpoint.policies.decisions.failures import failure_reason, is_ours, looks_like_lost_peer


def failure_report(error: BaseException) -> tuple[str, str]:
    """(reason, details) of a failure: the one rule for a failed run's last line and for the failure
    policy's message of each failed rank.

    The reason is the failing code's own exception, not Ray's wrapper: Ray Train v2 keeps each
    worker's exception object (``WorkerGroupError.worker_failures``, each wrapped with its
    traceback text), which names where its rank was (``syncpoint.workers.supervision.failure_site``). Of several failed
    ranks, ``failing_cause`` picks: a refusal or a bug on one rank often surfaces as a broken
    collective on the others.
    """
    return failure_reason(failing_cause(error))


def failing_cause(error: BaseException) -> BaseException:
    """The exception that says why a worker group failed (``failure_report``'s rule, also the failure
    policy's for telling a repeated bug): syncpoint's own refusal first, then the lowest rank's own
    error over a peer's lost connection (a rank that raised leaves the others' collectives broken),
    then the lowest rank's."""
    failures = getattr(error, "worker_failures", None) or {}
    causes = [own_exception(failures[rank]) for rank in sorted(failures)] or [own_exception(error)]
    return next((c for c in causes if is_ours(c)), None) or next(
        (c for c in causes if not looks_like_lost_peer(str(c))), causes[0]
    )


def own_exception(error: BaseException) -> BaseException:
    """The exception that says why: Ray wraps a worker's in ``UserExceptionWithTraceback``
    (``_base_exc``) and the controller's in ``ControllerError`` (``controller_failure``)."""
    for wrapped in ("_base_exc", "controller_failure"):
        inner = getattr(error, wrapped, None)
        if isinstance(inner, BaseException):
            return own_exception(inner)
    return error
