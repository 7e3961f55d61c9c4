"""The commands that check, start or rehearse a job: ``validate``, ``run``, ``submit``, ``drill``, ``k8s``, ``schema``.

Why apart from the readers of a run directory (``cli_inspect``): these import the driver's Ray wiring
when they run a job, and check the job's imports and storage before anything starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING

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
    from syncpoint.orchestrator.interruptions import InterruptionKind
from syncpoint.orchestrator.cli_inputs import load_job, metrics_port_arg


def cmd_validate(args: argparse.Namespace) -> int:
    """``syncpoint validate``: the spec, the task's import and what each setting does, without building anything."""
    spec = load_job(args)
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
    metrics_port = None if args.metrics_port is None else metrics_port_arg(args.metrics_port)
    if args.local:
        if args.address or args.dashboard or metrics_port is not None:
            flag = "--address" if args.address else "--dashboard" if args.dashboard else "--metrics-port"
            raise UsageError(flag, [f"{flag} is for a run on Ray; --local runs the ranks here without Ray: drop one"])
        from syncpoint.orchestrator.local_runner import prewarmed, run_local
        from syncpoint.orchestrator.ray_runner import show_outcome

        raw = job_spec(args)
        with prewarmed(raw) as submission:  # its warm server imports torch while the spec is checked
            spec = prepare_run(raw, args.job)
            return show_outcome(run_local(spec, rerun_command(args), submission)).code
    spec = run_spec(args)
    from syncpoint.orchestrator.progress_bar import show_progress_bar
    from syncpoint.orchestrator.ray_runner import run_on_ray

    if args.dashboard and (args.address or os.environ.get("RAY_ADDRESS")):
        print("syncpoint: --dashboard applies to an embedded Ray; a cluster serves its own dashboard", file=sys.stderr)
    if metrics_port is not None and (args.address or os.environ.get("RAY_ADDRESS")):
        print(
            "syncpoint: --metrics-port applies to an embedded Ray; on a cluster the run's syncpoint_* series are "
            "served by the metrics port of the node its driver runs on (`ray start --metrics-export-port`, "
            "KubeRay's 8080)",
            file=sys.stderr,
        )
    return run_on_ray(
        spec,
        args.address,
        progress_bar=show_progress_bar(sys.stdout, os.environ),
        dashboard=args.dashboard,
        rerun=rerun_command(args),
        metrics_port=metrics_port,
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
    if getattr(args, "local", False):
        parts.append("--local")
    return shlex.join(parts) + (" --address DASHBOARD" if submitted else "")


def run_spec(args: argparse.Namespace) -> JobSpec:
    """The spec ``syncpoint run`` runs: the job file, its ``--set`` overrides, then ``--fresh``'s
    (``START_OVER``: they win over a ``resume`` of the file or of ``--set``, for this submission only)."""
    return prepare_run(job_spec(args), args.job)


def job_spec(args: argparse.Namespace) -> JobSpec:
    """``run_spec`` before ``prepare_run``'s checks."""
    return load_spec(args.job, [*args.set, *START_OVER] if args.fresh else args.set)


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


def cmd_submit(args: argparse.Namespace) -> int:
    """``syncpoint submit``: the job through Ray's Job API, with the working directory shipped."""
    from syncpoint.orchestrator.submit import submit

    spec = load_job(args)
    return submit(
        spec, args.job, args.set, args.address, args.working_dir, follow=not args.no_wait, token_file=args.token_file
    )


def cmd_drill(args: argparse.Namespace) -> int:
    """``syncpoint drill``: the job uninterrupted and interrupted, compared bit for bit."""
    from syncpoint.orchestrator.drill import run_drill

    spec = load_job(args)
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
    points, kinds = drill_points(args)  # the drill's own arguments first: a typo costs no child import
    check_imports(spec, args.job)
    _check_storage(spec)
    from syncpoint.orchestrator.drill import drill_stopped
    from syncpoint.orchestrator.driver_signals import DriverSignals
    from syncpoint.orchestrator.run_watchdog import ensure

    ensure()  # nothing the drill starts (its clusters, their warm servers) outlives it, however it ends
    # the driver's signals are the notice of the run in progress, as for `syncpoint run`
    rerun = redact_text(drill_command(args), spec.storage)
    with DriverSignals(spec.checkpoint.sigterm_grace_s, _say, rerun, rerun_resumes=False) as signals:
        signals.install()
        try:
            report = run_drill(spec, points, kinds, args.address, replacement=not args.no_replacement, signals=signals)
        except KeyboardInterrupt:  # a second signal (``driver_signals.StopNow``), or Ray's own for it
            if not signals.at_once:
                raise
            report = drill_stopped(points, kinds, signals, "a run, at once on a second signal")
    print(report.table)
    return report.code


def drill_points(args: argparse.Namespace) -> tuple[list[int], list[InterruptionKind]]:
    """``--preempt-at``, ``--how`` and ``--no-replacement`` checked (each refusal a ``UsageError`` naming
    its flag): the micro-steps to interrupt at and how. Why before the spec's checks: they read only
    the command line, and the import check a spec's refusal needs imports the task in a child (torch
    among its imports: seconds)."""
    from syncpoint.orchestrator.interruptions import DRILL_KINDS, InterruptionKind

    try:
        points = [int(p) for p in args.preempt_at.split(",") if p.strip()]
    except ValueError:
        raise UsageError("--preempt-at", [f"{args.preempt_at!r}: give micro-steps as P[,Q...], e.g. 13,40"]) from None
    if not points or min(points) < 1 or points != sorted(set(points)):
        raise UsageError("--preempt-at", [f"{args.preempt_at!r}: give increasing micro-steps >= 1, e.g. 13,40"])
    hows = [h.strip() for h in (args.how or InterruptionKind.CRASH).split(",")]
    bad = [h for h in hows if h not in DRILL_KINDS]
    if bad or len(hows) not in (1, len(points)):
        raise UsageError(
            "--how", [f"{args.how!r}: one of {', '.join(DRILL_KINDS)} — one for all points or one per point"]
        )
    if args.no_replacement and InterruptionKind.NODE not in hows:
        raise UsageError("--no-replacement", ["only applies to --how node (a lost node that is not replaced)"])
    return points, [InterruptionKind(h) for h in hows]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def drill_command(args: argparse.Namespace) -> str:
    """The command that runs this drill again (it starts its two runs over): the job file and the
    options that change the drill."""
    import shlex

    parts = ["syncpoint", "drill", args.job, "--preempt-at", args.preempt_at]
    if args.how:
        parts += ["--how", args.how]
    if args.no_replacement:
        parts.append("--no-replacement")
    for override in args.set or []:
        parts += ["--set", override]
    if args.address:
        parts += ["--address", redact_url(args.address)]
    return shlex.join(parts)


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
    from syncpoint.orchestrator.drill import stopped_report
    from syncpoint.orchestrator.driver_signals import DriverSignals
    from syncpoint.orchestrator.run_watchdog import ensure

    ensure()  # nothing the storm starts (its cluster, its warm servers) outlives it, however it ends
    # the driver's signals are the notice of the run in progress, as for `syncpoint run` and a drill
    rerun = redact_text(
        shlex.join(["syncpoint", "drill", args.job, "--storm", str(args.storm), "--seed", str(seed)]), spec.storage
    )
    with DriverSignals(spec.checkpoint.sigterm_grace_s, _say, rerun, rerun_resumes=False) as signals:
        signals.install()
        try:
            report = run_storm(spec, args.storm, seed, signals=signals)
        except StormTooShort as e:
            raise UsageError("--storm", [str(e)]) from None
        except KeyboardInterrupt:  # a second signal (``driver_signals.StopNow``), or Ray's own for it
            if not signals.at_once:
                raise
            report = stopped_report(
                f"storm: {args.storm} interruptions, seed {seed}", "storm", signals, "a run, at once on a second signal"
            )
    print(report.table)
    return report.code
