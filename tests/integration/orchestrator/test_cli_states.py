"""``syncpoint states`` and ``syncpoint digest`` read a run without running anything."""

from __future__ import annotations

import json

from syncpoint.orchestrator.cli import main
from syncpoint.workers.storage import RunStorage
from tests.helpers import digest, linear_spec, run


def test_states_table_json_and_policies(tmp_path, capsys):
    spec = linear_spec(
        tmp_path,
        "task.config.num_samples=10",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    )
    run(spec)
    store = RunStorage(spec.run_url)
    store.remove("states", f"{20:012d}", "manifest.json")  # newest becomes torn
    run_dir = spec.run_url[len("file://") :]
    capsys.readouterr()
    assert main(["states", run_dir, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    verdicts = {c["state"]: c["verdict"] for c in out["candidates"]}
    assert verdicts[f"{20:012d}"] == "torn" and verdicts[f"{18:012d}"] == "resumable"
    assert out["choice"]["state"] == f"{18:012d}"
    assert main(["states", run_dir, "--policy", "pinned", "--policy-args", '{"state": 8}']) == 0
    text = capsys.readouterr().out
    assert "torn" in text and "resume from 000000000008" in text
    assert main(["states", run_dir, "--policy", "no.such:Policy"]) == 2
    assert "cannot import" in capsys.readouterr().err


def test_digest_command_matches_library_and_ignores_timestamps(tmp_path, capsys):
    a = linear_spec(tmp_path / "a", "task.config.num_samples=10")
    b = linear_spec(tmp_path / "b", "task.config.num_samples=10")
    run(a)
    run(b)
    name = f"{10:012d}"
    capsys.readouterr()
    assert main(["digest", a.run_url + "/states/" + name]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == digest(a, name) == digest(b, name)  # two runs, other times and paths: same digest
    assert main(["digest", str(tmp_path / "nope")]) == 2


def test_events_timeline_and_plot(tmp_path, capsys):
    from tests.helpers import run_until_crash, with_overrides

    spec = linear_spec(
        tmp_path,
        "task.config.num_samples=10",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 13, mode: raise}]",
    )
    assert run_until_crash(spec)
    run(with_overrides(spec, "faults=[]"))
    capsys.readouterr()
    png = tmp_path / "run.png"
    assert main(["events", spec.run_url, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "attempt 2" in out and "from 000000000010" in out
    assert "lost micro-steps" in out and "restart" in out
    (lost_row,) = [ln.split() for ln in out.splitlines() if ln.split()[:1] == ["2"]]  # the restart table's row
    assert lost_row[3] == "3" and lost_row[5:] == ["from", "progress"]  # crashed after 13, resumed from 10; no Ray
    assert "goodput" in out and "after attempt 1: 3 micro-steps recomputed" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["events", str(tmp_path / "empty")]) == 2
