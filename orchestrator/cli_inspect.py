"""The commands that read a run directory: ``states``, ``digest``, ``events``, ``status`` (and their plots).

Why apart: they never start Ray or train; each reads storage as every reader does, bounded and
safe on hostile storage, and prints for a person (or ``--json`` for a script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import UsageError
from syncpoint.policies.decisions.redact import redact_url

if TYPE_CHECKING:
    pass
from syncpoint.orchestrator.cli_inputs import as_url, directory_arg, first_line

MAX_POLICY_ARGS_BYTES = 64 << 10  # --policy-args: keyword arguments, a few dozen bytes


MAX_POLICY_ARGS_DEPTH = 8


PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # what --plot writes, by the file's extension


def cmd_states(args: argparse.Namespace) -> int:
    """``syncpoint states``: every state of a run, its verdict and reason, and what a resume would choose."""
    from syncpoint.orchestrator.status import run_identity
    from syncpoint.policies.contracts.errors import NoResumableState, RunDirectoryRefused
    from syncpoint.policies.decisions.candidates import candidates_table, classify
    from syncpoint.policies.decisions.resume import enforce_safe
    from syncpoint.workers.integrity.signing import load_key
    from syncpoint.workers.observation.events import event_files
    from syncpoint.workers.state.discovery import discover, states_entries

    storage = directory_arg(args.run_dir, "RUN_DIR", "a run directory", "<storage>/<name>")
    try:
        empty = not states_entries(storage) and not event_files(storage)
    except RunDirectoryRefused as e:  # states/ is a link: never followed
        raise UsageError("RUN_DIR", [str(e)]) from None
    if empty:
        raise UsageError(
            "RUN_DIR", [f"{args.run_dir}: no states or events here; pass a run directory (<storage>/<name>)"]
        )
    try:
        key = load_key(args.signing_key_env, "--signing-key-env")
    except ValueError as e:
        raise UsageError("--signing-key-env", [str(e)]) from None
    cands = discover(storage, signing_key=key)
    live = run_identity(cands)
    for c in cands:
        classify(c, live)
    policy = make_policy_for_cli(args.policy, policy_args_of(args.policy_args))
    try:
        decision = enforce_safe(policy.choose(cands, {}), cands)
        choice: Choice = {"state": decision.state, "reason": decision.reason}
    except NoResumableState as e:
        choice = {"state": None, "error": str(e).splitlines()[0]}
    if args.json:
        print(
            json.dumps(
                {
                    "run": redact_url(storage.url),
                    "candidates": [
                        {
                            "state": c.name,
                            "micro_step": c.micro_step,
                            "verdict": c.verdict.value if c.verdict else None,
                            "reason": c.reason,
                        }
                        for c in cands
                    ],
                    "choice": choice,
                },
                indent=2,
            )
        )
    else:
        print(f"run: {redact_url(storage.url)}")
        print(candidates_table(cands) if cands else "(no states)")
        print(
            f"policy {args.policy}: "
            + (
                f"resume from {choice['state']} ({choice['reason']})"
                if choice.get("state")
                else choice.get("error") or choice.get("reason", "")
            )
        )
    return 0


class Choice(TypedDict, total=False):
    """What ``syncpoint states`` says the policy chose: a state and why, or no state and the error."""

    state: str | None
    reason: str
    error: str


def policy_args_of(text: str | None) -> JSONObject:
    """``--policy-args``: a JSON object of keyword arguments, small and shallow (exit 2 otherwise)."""
    from syncpoint.policies.contracts.bounded_json import BoundedJsonError, loads_bounded

    if not text:
        return {}
    try:
        value = loads_bounded(text, max_bytes=MAX_POLICY_ARGS_BYTES, max_depth=MAX_POLICY_ARGS_DEPTH)
    except BoundedJsonError as e:
        raise UsageError(
            "--policy-args",
            [f"{text[:80]!r} is {e if str(e).startswith('not JSON') else f'JSON {e}'}; e.g. '{{\"state\": 120}}'"],
        ) from None
    if not isinstance(value, dict):
        raise UsageError(
            "--policy-args", [f"{text[:80]!r} must be a JSON object of keyword arguments, e.g. '{{\"state\": 120}}'"]
        )
    return value


def make_policy_for_cli(name: str, policy_args: Mapping[str, object]) -> Any:
    """The policy ``syncpoint states`` asks: a built-in, or the class a custom import path names
    (checked to be a policy class before it is instantiated: ``os:system`` is refused, never called)."""
    from syncpoint.policies.contracts.import_path import load_class
    from syncpoint.policies.decisions.resume import BUILTIN, make_policy

    if name not in BUILTIN:
        try:
            load_class(name, "choose")
        except ValueError as e:
            raise UsageError(
                "--policy",
                [
                    f"{e}; give a built-in policy ({', '.join(BUILTIN)}) or pkg.mod:Class, "
                    "a class with a choose(candidates, spec) method"
                ],
            ) from None
    try:
        return make_policy(name, policy_args)
    except (ValueError, TypeError) as e:
        raise UsageError(
            "--policy",
            [f"{name}: {e}; check --policy-args (pinned needs '{{\"state\": N}}', best-metric takes metric and mode)"],
        ) from None


def cmd_digest(args: argparse.Namespace) -> int:
    """``syncpoint digest``: a state's content digest (what drills compare), verified against its manifest."""
    from syncpoint.policies.contracts.errors import StateRefused
    from syncpoint.workers.integrity.digest import state_digest

    directory_arg(args.state_dir, "STATE_DIR", "a committed state", "<run>/states/<name>")
    try:
        d = state_digest(as_url(args.state_dir))
    except StateRefused as e:  # whatever the state's content is: digest refuses what loading refuses
        raise UsageError(
            "STATE_DIR",
            [f"{args.state_dir}: refused to read this state: {e}; `syncpoint states <run>` shows its verdict"],
        ) from None
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
        raise UsageError(
            "STATE_DIR", [f"{args.state_dir}: not a committed state ({e}); pass <run>/states/<name>"]
        ) from None
    except OSError as e:  # the storage failing, not the state
        raise UsageError(
            "STATE_DIR",
            [f"{args.state_dir}: the storage failed while reading it ({type(e).__name__}: {first_line(e)}); try again"],
        ) from None
    except MemoryError:  # within the load bounds: this machine, not the state
        raise UsageError(
            "STATE_DIR",
            [
                f"{args.state_dir}: this machine ran out of memory digesting it (digest holds "
                "one state file and its tensors in memory at a time); run it where the "
                "training ran"
            ],
        ) from None
    print(json.dumps(d, indent=2) if args.json else d["digest"])
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    """``syncpoint events``: a run's timeline from its event log (attempts, failures, saves, goodput)."""
    from syncpoint.orchestrator.timeline import format_timeline
    from syncpoint.policies.contracts.journal import Journal
    from syncpoint.workers.observation.events import EventLog, skipped_line

    if args.plot:
        _check_plot_path(args.plot)
    stored = EventLog(directory_arg(args.run_dir, "RUN_DIR", "a run directory", "<storage>/<name>")).read_stored()
    if not stored.records and not stored.skipped:
        raise UsageError("RUN_DIR", [f"{args.run_dir}: no events found; pass a run directory (<storage>/<name>)"])
    journal = Journal.parse(stored.records, skipped=[str(u) for u in stored.skipped])
    if args.plot:
        _plot(journal, args.plot, args.run_dir)
    if journal.skipped:  # on stderr with --json: stdout stays the records as stored
        print(skipped_line(journal.skipped), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(stored.records, indent=1))
    else:
        print(format_timeline(journal))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``syncpoint status``: where a run stands now (running, stopped, finished, failed), its newest
    resumable state, goodput and badput so far, and its last interruption; reads metadata only."""
    from syncpoint.orchestrator.status import NotARun, format_status, read_status, status_json
    from syncpoint.workers.integrity.signing import load_key

    storage = directory_arg(args.run_dir, "RUN_DIR", "a run directory", "<storage>/<name>")
    try:
        key = load_key(args.signing_key_env, "--signing-key-env")
    except ValueError as e:
        raise UsageError("--signing-key-env", [str(e)]) from None
    try:
        status = read_status(storage, signing_key=key)
    except NotARun as e:
        raise UsageError("RUN_DIR", [str(e)]) from None
    print(json.dumps(status_json(status), indent=2) if args.json else format_status(status))
    return 0


def _check_plot_path(path: str) -> None:
    """``--plot``: a file to write in an existing directory, with an extension the plot can be drawn as;
    refused (exit 2) before the log is read."""
    parent = os.path.dirname(os.path.abspath(path))
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if os.path.isdir(path):
        problem = "is a directory"
    elif not os.path.isdir(parent):
        problem = f"is in {parent}, which is not an existing directory"
    elif ext not in PLOT_FORMATS:
        problem = f"has the extension {ext[:20]!r}" if ext else "has no extension"
    else:
        return
    raise UsageError(
        "--plot",
        [
            f"{path}: {problem}; name a new file in an existing directory, ending in "
            f"{', '.join('.' + f for f in PLOT_FORMATS)} (e.g. --plot run.png)"
        ],
    )


def _plot(journal: Any, path: str, title: str) -> None:
    from syncpoint.orchestrator.plot import plot_run

    try:
        plot_run(journal, path, title=title)
    except (OSError, ValueError) as e:
        raise UsageError(
            "--plot",
            [
                f"{path}: the plot cannot be written ({type(e).__name__}: {first_line(e)}); "
                "name a new file in a directory you can write"
            ],
        ) from None
