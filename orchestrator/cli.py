"""``syncpoint`` command line: run, submit, validate, k8s, schema, states, digest, events, status, drill.

Bad input (a spec, an argument, a storage URL) exits 2 with a paragraph naming what is wrong and
how to fix it; a failed run exits 1 with the reason; nothing here prints a bare traceback. Output
cut short by its reader (``syncpoint events --json | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from syncpoint.orchestrator.import_check import import_paths
from syncpoint.orchestrator.spec_file import (
    START_OVER,
    load_spec,
    overridden_mapping,
    parse_spec,
    read_spec_file,
    resolve_storage,
)
from syncpoint.policies.contracts.errors import SpecError, UsageError
from syncpoint.policies.contracts.spec import JobSpec, job_schema, spec_to_json
from syncpoint.policies.decisions.redact import redact_text, redact_url

if TYPE_CHECKING:
    from syncpoint.workers.storage import RunStorage

MAX_POLICY_ARGS_BYTES = 64 << 10  # --policy-args: keyword arguments, a few dozen bytes
MAX_POLICY_ARGS_DEPTH = 8
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")  # what --plot writes, by the file's extension


def _load(args: argparse.Namespace) -> JobSpec:
    return resolve_storage(load_spec(args.job, args.set))


def cmd_validate(args: argparse.Namespace) -> int:
    """``syncpoint validate``: the spec, the task's import and what each setting does, without building anything."""
    spec = _load(args)
    facts = check_imports(spec, args.job)
    print(spec_to_json(spec))
    note = optimizer_note(str(facts.get("task.path", {}).get("optimizer", "unknown")))
    if note:
        print(f"syncpoint: note: {note}", file=sys.stderr)  # stdout stays the spec's JSON
    return 0


# validate prints every field, also those a Task.optimizer makes unused. Whether the task sets one is
# read from its builder's source (validate builds nothing: syncpoint.orchestrator.import_check).
OPTIMIZER_NOTE = (
    "train.lr and train.optimizer build the optimizer only for a task without Task.optimizer; a "
    "Task.optimizer's param groups carry their own lr and settings instead, and train.scheduler scales "
    "each group's lr (the workers say which one is in effect)"
)


def optimizer_note(site: str) -> str | None:
    """What validate says of train.lr/train.optimizer: not in effect where the task's builder sets
    Task.optimizer (``site`` "at file:line"), nothing where it builds a Task without one ("none"),
    the general rule where its source does not tell ("unknown")."""
    if site.startswith("at "):
        return (
            f"train.lr and train.optimizer (its type, weight_decay, betas, no_decay) are not in effect: the task "
            f"sets Task.optimizer ({site}), whose param groups carry their own lr and settings; train.scheduler "
            "still scales each group's lr"
        )
    return None if site == "none" else OPTIMIZER_NOTE


def cmd_k8s(args: argparse.Namespace) -> int:
    """The KubeRay manifests for a job file: the file validated as ``validate`` does (read once: the
    ConfigMap carries exactly what was validated), then ``syncpoint.orchestrator.k8s_render``."""
    from syncpoint.orchestrator.k8s_render import emit, plan

    text = read_spec_file(args.job)
    spec = resolve_storage(parse_spec(text, args.job, args.set))
    p = plan(
        spec,
        overlay=args.overlay,
        image=args.image,
        code_from=args.code_from,
        image_has_code=args.image_has_code,
        manifests=args.manifests,
    )
    check_imports(spec, args.job)
    return emit(p, overridden_mapping(text, args.set), args.output)


def cmd_schema(args: argparse.Namespace) -> int:
    """``syncpoint schema``: the job spec's JSON schema on stdout."""
    print(json.dumps(job_schema(), indent=2))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """``syncpoint run``: the job on Ray (embedded unless an address is given); the last line says how it ended."""
    spec = run_spec(args)
    from syncpoint.orchestrator.progress_bar import show_progress_bar
    from syncpoint.orchestrator.ray_runner import run_on_ray

    if args.dashboard and (args.address or os.environ.get("RAY_ADDRESS")):
        print("syncpoint: --dashboard applies to an embedded Ray; a cluster serves its own dashboard", file=sys.stderr)
    return run_on_ray(
        spec,
        args.address,
        progress_bar=show_progress_bar(sys.stdout, os.environ),
        dashboard=args.dashboard,
        rerun=rerun_command(args),
    )


RAY_JOB_DRIVER = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor in a Ray Job's driver


def rerun_command(args: argparse.Namespace) -> str:
    """The command that resumes this run, as the stopped run's last line shows it: the job file and
    the options that change the job (``--set``, ``--address``)."""
    import shlex

    submitted = RAY_JOB_DRIVER in os.environ  # `syncpoint submit`'s driver, a Ray Job: submitted again
    parts = ["syncpoint", "submit" if submitted else "run", args.job]
    for override in args.set or []:
        parts += ["--set", override]
    if args.address and not submitted:
        parts += ["--address", redact_url(args.address)]
    return shlex.join(parts) + (" --address DASHBOARD" if submitted else "")


def run_spec(args: argparse.Namespace) -> JobSpec:
    """The spec ``syncpoint run`` runs: the job file, its ``--set`` overrides, then ``--fresh``'s
    (``START_OVER``: they win over a ``resume`` of the file or of ``--set``, for this submission only)."""
    return prepare_run(load_spec(args.job, [*args.set, *START_OVER] if args.fresh else args.set), args.job)


def prepare_run(spec: JobSpec, source: str) -> JobSpec:
    """What ``syncpoint run`` does before Ray starts (``syncpoint.run`` too): the storage made an absolute
    URL, every import path resolved, the run directory written once; bad input raises ``SpecError``
    naming ``source``."""
    spec = resolve_storage(spec)
    check_imports(spec, source)
    _check_storage(spec)
    return spec


def check_imports(spec: JobSpec, source: str, base_dir: str | None = None) -> dict[str, dict]:
    """Before Ray starts: refuse (exit 2) a spec whose ``task.path`` — or ``resume.policy`` /
    ``checkpoint.save_trigger`` / ``train.scheduler.path`` when they are import paths — does not
    resolve to an object of its kind (``syncpoint.orchestrator.import_check``), one paragraph per path,
    whose ``train.report_to`` names a tracker that cannot work here (``syncpoint.workers.observation.trackers``),
    or whose ``resume.policy_args`` a built-in policy does not take.
    Returns each path's result (``task.path``'s says where its builder sets ``Task.optimizer``)."""
    from syncpoint.policies.decisions.resume import policy_args_problem
    from syncpoint.workers.observation.trackers import tracker_problems

    facts: dict[str, dict] = {}
    problems = import_problems(import_paths(spec), base_dir, facts) + tracker_problems(spec)
    # a built-in policy's arguments, by its own model (a custom policy's: by its constructor, on the workers)
    args_problem = policy_args_problem(spec.resume.policy, spec.resume.policy_args)
    if args_problem:
        problems.append(args_problem)
    if problems:
        raise SpecError(source, problems)
    return facts


def import_problems(
    paths: list[tuple[str, str]], base_dir: str | None = None, facts: dict[str, dict] | None = None
) -> list[str]:
    """One paragraph per import path that does not resolve where the workers look: ``base_dir``
    (default the working directory, which the driver puts first on the workers' PYTHONPATH), then the
    installed packages. Each module is imported in a child Python, bounded in time
    (``syncpoint.orchestrator.import_check``), never in this process. ``syncpoint submit`` runs this on the cluster."""
    from syncpoint.orchestrator.import_check import resolve_problems

    return resolve_problems(paths, os.path.abspath(base_dir or os.getcwd()), facts=facts)


def _check_storage(spec: JobSpec) -> None:
    """Before anything starts: can the run directory be written (a probe file written and removed,
    through storage: a planted link at the probe's name is replaced, never written through)?"""
    from syncpoint.workers.storage import RunStorage

    try:
        storage = RunStorage(spec.run_url)
        storage.write_bytes(b"ok", ".syncpoint-probe")
        storage.remove(".syncpoint-probe")
    except Exception as e:  # noqa: BLE001 - every backend raises its own types; each is a spec error
        # redacted with the URL's own secrets too: a backend's error may quote a password bare
        raise SpecError(
            "storage",
            [
                redact_text(
                    f"storage {spec.storage!r} is not usable: {type(e).__name__}: {e}. Use a local path, file://, "
                    "memory:// "
                    "or an fsspec URL whose backend is installed (s3:// needs s3fs) with credentials available, and "
                    "write "
                    "access",
                    spec.storage,
                )
            ],
        ) from None


def _storage(arg: str, what: str) -> RunStorage:
    from syncpoint.workers.storage import RunStorage

    try:
        return RunStorage(_as_url(arg))
    except (ValueError, ImportError) as e:
        raise SpecError(
            what, [redact_text(f"{arg}: {e}; pass a local path or an fsspec URL whose backend is installed", arg)]
        ) from None


def _directory(arg: str, what: str, kind: str, example: str) -> RunStorage:
    """The storage of a directory the command reads (a run, a state), refused (exit 2) when it is a
    local file rather than a directory, or when the storage cannot be listed at all (an unreachable
    endpoint, missing credentials): one paragraph, before anything is read."""
    storage = _storage(arg, what)
    local = storage.local_path()
    if local is not None:
        if os.path.exists(local) and not os.path.isdir(local):
            raise UsageError(what, [f"{arg}: not a directory, so not {kind}; pass {example}"])
        return storage
    try:
        storage.list_names()
    except Exception as e:  # noqa: BLE001 - every backend raises its own types when it cannot be reached
        raise UsageError(
            what,
            [
                redact_text(
                    f"{arg}: the storage cannot be read ({type(e).__name__}: "
                    f"{_first_line(e)}); check the URL, the endpoint and the credentials, "
                    f"and pass {kind}, {example}",
                    arg,
                )
            ],
        ) from None
    return storage


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def cmd_submit(args: argparse.Namespace) -> int:
    """``syncpoint submit``: the job through Ray's Job API, with the working directory shipped."""
    from syncpoint.orchestrator.submit import submit

    spec = _load(args)
    return submit(
        spec, args.job, args.set, args.address, args.working_dir, follow=not args.no_wait, token_file=args.token_file
    )


def cmd_states(args: argparse.Namespace) -> int:
    """``syncpoint states``: every state of a run, its verdict and reason, and what a resume would choose."""
    from syncpoint.orchestrator.status import run_expectation
    from syncpoint.policies.contracts.errors import NoResumableState, RunDirectoryRefused
    from syncpoint.policies.decisions.candidates import candidates_table, classify
    from syncpoint.policies.decisions.resume import enforce_safe
    from syncpoint.workers.integrity.signing import load_key
    from syncpoint.workers.observation.events import event_files
    from syncpoint.workers.state.discovery import discover, states_entries

    storage = _directory(args.run_dir, "RUN_DIR", "a run directory", "<storage>/<name>")
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
    exp = run_expectation(cands)
    for c in cands:
        classify(c, exp)
    policy = make_policy_for_cli(args.policy, policy_args_of(args.policy_args))
    try:
        decision = enforce_safe(policy.choose(cands, {}), cands)
        choice: dict[str, Any] = {"state": decision.state, "reason": decision.reason}
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


def policy_args_of(text: str | None) -> dict[str, Any]:
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


def make_policy_for_cli(name: str, policy_args: dict[str, Any]) -> Any:
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

    _directory(args.state_dir, "STATE_DIR", "a committed state", "<run>/states/<name>")
    try:
        d = state_digest(_as_url(args.state_dir))
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
            [
                f"{args.state_dir}: the storage failed while reading it "
                f"({type(e).__name__}: {_first_line(e)}); try again"
            ],
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
    stored = EventLog(_directory(args.run_dir, "RUN_DIR", "a run directory", "<storage>/<name>")).read_stored()
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

    storage = _directory(args.run_dir, "RUN_DIR", "a run directory", "<storage>/<name>")
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
                f"{path}: the plot cannot be written ({type(e).__name__}: {_first_line(e)}); "
                "name a new file in a directory you can write"
            ],
        ) from None


def cmd_drill(args: argparse.Namespace) -> int:
    """``syncpoint drill``: the job uninterrupted and interrupted, compared bit for bit."""
    from syncpoint.orchestrator.drill import run_drill

    spec = _load(args)
    if (args.preempt_at is None) == (args.storm is None):
        raise UsageError(
            "--preempt-at",
            [
                "give --preempt-at P[,Q...] (interrupt at these micro-steps) or --storm N "
                "(N interruptions at random points and of random kinds), one of the two"
            ],
        )
    if args.storm is not None:
        return _storm(args, spec)
    check_imports(spec, args.job)
    _check_storage(spec)
    try:
        points = [int(p) for p in args.preempt_at.split(",") if p.strip()]
    except ValueError:
        raise UsageError("--preempt-at", [f"{args.preempt_at!r}: give micro-steps as P[,Q...], e.g. 13,40"]) from None
    if not points or min(points) < 1 or points != sorted(set(points)):
        raise UsageError("--preempt-at", [f"{args.preempt_at!r}: give increasing micro-steps >= 1, e.g. 13,40"])
    from syncpoint.orchestrator.interruptions import DRILL_KINDS, InterruptionKind

    hows = [h.strip() for h in (args.how or InterruptionKind.CRASH).split(",")]
    bad = [h for h in hows if h not in DRILL_KINDS]
    if bad or len(hows) not in (1, len(points)):
        raise UsageError(
            "--how", [f"{args.how!r}: one of {', '.join(DRILL_KINDS)} — one for all points or one per point"]
        )
    if args.no_replacement and InterruptionKind.NODE not in hows:
        raise UsageError("--no-replacement", ["only applies to --how node (a lost node that is not replaced)"])
    from syncpoint.orchestrator.run_watchdog import ensure

    ensure()  # nothing the drill starts (its clusters, their warm servers) outlives it, however it ends
    report = run_drill(
        spec, points, [InterruptionKind(h) for h in hows], args.address, replacement=not args.no_replacement
    )
    print(report.table)
    return 0 if report.ok else 1


def _storm(args: argparse.Namespace, spec: JobSpec) -> int:
    import random

    from syncpoint.orchestrator.storm import MAX_STORM, StormTooShort, run_storm

    if not 1 <= args.storm <= MAX_STORM:
        raise UsageError("--storm", [f"{args.storm}: give between 1 and {MAX_STORM} interruptions"])
    for flag, given in (("--how", args.how), ("--no-replacement", args.no_replacement), ("--address", args.address)):
        if given:
            raise UsageError(
                flag,
                [
                    f"{flag} does not apply to --storm: a storm draws its kinds itself and runs on "
                    "its own local multi-node cluster (one node per worker); drop it"
                ],
            )
    if args.seed is not None and not 0 <= args.seed <= 2**63 - 1:
        raise UsageError("--seed", [f"{args.seed}: give a seed between 0 and 2**63-1"])
    check_imports(spec, args.job)
    _check_storage(spec)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    from syncpoint.orchestrator.run_watchdog import ensure

    ensure()  # nothing the storm starts (its cluster, its warm servers) outlives it, however it ends
    try:
        report = run_storm(spec, args.storm, seed)
    except StormTooShort as e:
        raise UsageError("--storm", [str(e)]) from None
    print(report.table)
    return 0 if report.ok else 1


def _as_url(path: str) -> str:
    return path if "://" in path else "file://" + os.path.abspath(path)


def build_parser() -> argparse.ArgumentParser:
    """The ``syncpoint`` argument parser (docs/reference/cli.md is written from it)."""
    p = argparse.ArgumentParser(prog="syncpoint", description="Preemption-proof DeepSpeed training on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    def with_spec(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("job", help="job spec YAML file")
        sp.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="a.b=value",
            help="override a spec field (value parsed as YAML); repeatable",
        )

    r = sub.add_parser("run", help="run a job (embedded local Ray unless --address/RAY_ADDRESS)")
    with_spec(r)
    r.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else embedded)")
    r.add_argument(
        "--dashboard", action="store_true", help="an embedded Ray also starts its dashboard (http://127.0.0.1:8265)"
    )
    r.add_argument(
        "--fresh",
        action="store_true",
        help="start the run over: its states are moved to <run>/archive/, its summary counts this submission only",
    )
    r.set_defaults(fn=cmd_run)
    sb = sub.add_parser("submit", help="submit the job to a Ray cluster's Job API (working dir shipped, logs streamed)")
    with_spec(sb)
    sb.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://HOST:8265")
    sb.add_argument("--working-dir", default=".", help="directory shipped with the job (default: .)")
    sb.add_argument("--no-wait", action="store_true", help="return after submitting")
    sb.add_argument(
        "--token-file",
        default=None,
        help="file holding the cluster's Ray auth token (default: RAY_AUTH_TOKEN, then the file named "
        "by RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token); sent only in the Authorization header",
    )
    sb.set_defaults(fn=cmd_submit)
    v = sub.add_parser("validate", help="print the normalized spec or its errors (exit 2)")
    with_spec(v)
    v.set_defaults(fn=cmd_validate)
    k = sub.add_parser(
        "k8s",
        help="render the KubeRay manifests (a kustomize overlay of k8s/) for a job file: its name, spec, workers",
    )
    with_spec(k)
    k.add_argument(
        "--overlay",
        choices=["eks-spot", "gke-spot", "karpenter-spot", "gpu"],
        default=None,
        help="flavour (default: base)",
    )
    k.add_argument("--image", default=None, metavar="NAME@sha256:DIGEST", help="the image every pod runs, by digest")
    code = k.add_mutually_exclusive_group()
    code.add_argument(
        "--code-from",
        default=None,
        metavar="s3://BUCKET/code.zip",
        help="a zip of your code that Ray fetches as the job's working directory (the RayJob's runtimeEnvYAML)",
    )
    code.add_argument(
        "--image-has-code", action="store_true", help="the image installs your code (k8s/Dockerfile.user)"
    )
    k.add_argument(
        "-o",
        "--output",
        default="-",
        metavar="DIR",
        help="write the overlay directory DIR (apply with kubectl apply -k DIR); - (default): print the manifests "
        "that kubectl kustomize renders from it",
    )
    k.add_argument(
        "--manifests",
        default=None,
        metavar="PATH/k8s",
        help="the k8s/ directory to build on (default: this checkout's)",
    )
    k.set_defaults(fn=cmd_k8s)
    sub.add_parser("schema", help="print the job spec JSON schema").set_defaults(fn=cmd_schema)
    s = sub.add_parser(
        "states",
        help="list a run's states, their verdicts, and what a policy would choose (reads "
        "metadata only, runs no training)",
    )
    s.add_argument("run_dir")
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--policy",
        default="newest-resumable",
        help="newest-resumable, pinned, fresh, best-metric, or pkg.mod:Class: a class with a choose() "
        "method (its module is imported and the class built with --policy-args; anything else an "
        "import path names, such as os:system, is refused, never called)",
    )
    s.add_argument("--policy-args", default=None, help="JSON object of policy keyword arguments")
    s.add_argument(
        "--signing-key-env",
        default=None,
        metavar="NAME",
        help="verify signatures with the key in this environment variable (signed runs)",
    )
    s.set_defaults(fn=cmd_states)
    d = sub.add_parser("digest", help="canonical sha256 of a state (params, optimizer, position, RNG)")
    d.add_argument("state_dir")
    d.add_argument("--json", action="store_true", help="also print each component's hash")
    d.set_defaults(fn=cmd_digest)
    e = sub.add_parser("events", help="print a run's event timeline")
    e.add_argument("run_dir")
    e.add_argument("--json", action="store_true")
    e.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw loss and every param group's LR vs the optimizer step with saves/preemptions marked",
    )
    e.set_defaults(fn=cmd_events)
    st = sub.add_parser(
        "status",
        help="where a run stands: running (attempt N), stopped and resumable, finished or failed and why; its "
        "newest resumable state, goodput and badput so far, the last interruption (reads metadata only)",
    )
    st.add_argument("run_dir")
    st.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    st.add_argument(
        "--signing-key-env",
        default=None,
        metavar="NAME",
        help="verify signatures with the key in this environment variable (signed runs)",
    )
    st.set_defaults(fn=cmd_status)
    dr = sub.add_parser("drill", help="run reference + interrupted run, compare losses and final digest")
    with_spec(dr)
    dr.add_argument("--preempt-at", default=None, metavar="P[,Q...]", help="global micro-steps to interrupt at")
    dr.add_argument(
        "--storm",
        type=int,
        default=None,
        metavar="N",
        help="N interruptions of random kinds at random micro-steps (a seeded plan, printed first), on a "
        "local multi-node cluster",
    )
    dr.add_argument("--seed", type=int, default=None, help="with --storm: the plan's seed (default: a random one)")
    dr.add_argument("--how", default=None, help="crash|sigterm|node (default crash), or one per point: crash,sigterm")
    dr.add_argument("--address", default=None, help="Ray cluster address (crash/sigterm; default embedded)")
    dr.add_argument(
        "--no-replacement",
        action="store_true",
        help="with --how node: the lost node is not replaced (an elastic job continues on fewer workers)",
    )
    dr.set_defaults(fn=cmd_drill)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``syncpoint`` console script: parse, run the command, and turn a syncpoint error into
    its one-paragraph message and exit code 2 (never a traceback)."""
    from syncpoint.orchestrator.quiet import quiet_cli

    quiet_cli()
    args = build_parser().parse_args(argv)
    try:
        rc = int(args.fn(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader gone away is caught below
        return rc
    except SpecError as e:
        print(f"syncpoint: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "syncpoint: interrupted (SIGINT): stopped here; whatever was committed stays, and running the same "
            "command again resumes from it",
            file=sys.stderr,
            flush=True,
        )
        return 130
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """stdout's reader closed it (``| head``): stop quietly, as a Unix tool killed by SIGPIPE does
    (128 + 13). stdout is pointed at /dev/null so the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (captured): nothing is flushed to it at exit
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
