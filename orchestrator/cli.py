"""``syncpoint`` command line: run, submit, validate, k8s, schema, states, digest, events, status, drill.

Bad input (a spec, an argument, a storage URL) exits 2 with a paragraph naming what is wrong and
how to fix it; a failed run exits 1 with the reason; nothing here prints a bare traceback. Output
cut short by its reader (``syncpoint events --json | head -1``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from syncpoint.policies.contracts.errors import SpecError

if TYPE_CHECKING:
    pass
from syncpoint.orchestrator.cli_inspect import cmd_digest, cmd_events, cmd_states, cmd_status
from syncpoint.orchestrator.cli_jobs import cmd_drill, cmd_k8s, cmd_run, cmd_schema, cmd_submit, cmd_validate


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
        "--metrics-port",
        default=None,
        metavar="PORT",
        help="an embedded Ray serves its Prometheus metrics, the run's syncpoint_* series among them, at "
        "http://127.0.0.1:PORT/metrics (a cluster's own metrics port serves them on a cluster)",
    )
    r.add_argument(
        "--fresh",
        action="store_true",
        help="start the run over: its states are moved to <run>/archive/, its summary counts this submission only",
    )
    r.add_argument(
        "--local",
        action="store_true",
        help="run the ranks on this machine without Ray (the quickest start; same resume, failures in place, signals)",
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
