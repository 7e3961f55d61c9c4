"""Job spec: good specs load, each bad spec gets its specific error (path, line, fix)."""

from __future__ import annotations

import json

import pytest

from syncpoint.orchestrator.cli import main
from syncpoint.orchestrator.spec_file import load_spec, parse_spec, resolve_storage
from syncpoint.policies.contracts.errors import SpecError
from tests.helpers import EXAMPLE, ROOT

MINIMAL = """
name: job
task: {path: examples.tiny_lm:build}
train: {micro_batch_size: 2, epochs: 1}
"""


def test_example_and_minimal_specs_load():
    spec = load_spec(ROOT / "examples" / "tiny_lm.yaml")
    assert spec.scaling.num_workers == 2 and spec.deepspeed.zero_stage == 2 and spec.train.grad_accum == 4
    m = parse_spec(MINIMAL)
    assert m.storage == "./runs" and m.checkpoint.keep_last == 3 and m.resume.policy == "newest-resumable"
    assert resolve_storage(m, "/base").storage == "file:///base/runs"
    assert resolve_storage(parse_spec(MINIMAL, overrides=["storage=memory://x"])).storage == "memory://x"


def test_a_relative_init_from_is_the_drivers_directory_as_storage_is():
    """Ray workers run elsewhere: runs/pretrain/final must name the driver's, not a worker's, directory."""
    rel = resolve_storage(parse_spec(MINIMAL, overrides=["resume.init_from=runs/pretrain/final"]), "/base")
    assert rel.resume.init_from == "/base/runs/pretrain/final"
    for kept in ("/abs/run", "s3://bucket/run/states/000000000008", None):
        over = [f"resume.init_from={kept}"] if kept else []
        assert resolve_storage(parse_spec(MINIMAL, overrides=over), "/base").resume.init_from == kept


@pytest.mark.parametrize(
    "patch,expected",
    [
        (
            "train: {micro_batch_size: 2, epochs: 1, grad_accum: 0}",
            r"train.grad_accum \(line 4\).*greater than or equal to 1",
        ),
        ("train: {micro_batch_size: 2}", "set train.epochs or train.max_steps"),
        ("train: {micro_batch_size: 2, epochz: 1}", "train.epochz.*unknown key; allowed keys here are: .*epochs"),
        ("train: {micro_batch_size: two, epochs: 1}", "train.micro_batch_size.*integer.*'two'"),
        ("train: {micro_batch_size: 2, epochs: 1}\ndeepspeed: {zero_stage: 4}", "deepspeed.zero_stage.*0, 1, 2 or 3"),
        ("train: {micro_batch_size: 2, epochs: 1}\ndeepspeed: {precision: fp16}", "fp16 needs scaling.use_gpu"),
        ("train: {micro_batch_size: 2, epochs: 1}\ndeepspeed: {config: {train_batch_size: 8}}", "set by syncpoint"),
        ("train: {micro_batch_size: 2, epochs: 1}\ncheckpoint: {save_every: '5 weeks'}", "checkpoint.save_every.unit"),
        (
            "train: {micro_batch_size: 2, epochs: 1}\ncheckpoint: {save_every: {value: 1.5, unit: micro_steps}}",
            "whole number",
        ),
        ("train: {micro_batch_size: 2, epochs: 1}\nfaults: [{rank: 3, at_micro_step: 2}]", "rank 3 does not exist"),
        ("train: {micro_batch_size: 2, epochs: 1}\nfaults: [{rank: 0}]", "needs at_micro_step, phase, or both"),
        ("train: {micro_batch_size: 2, epochs: 1}\nbogus: 1", "bogus.*unknown key"),
        (
            "train: {micro_batch_size: 2, epochs: 1}\nscaling: {num_workers: 2}\nfaults: "
            "[{rank: 1, phase: before_manifest}]",
            "happens on rank 0 only",
        ),
    ],
)
def test_bad_specs_name_the_field(patch, expected):
    text = MINIMAL.replace("train: {micro_batch_size: 2, epochs: 1}", patch)
    with pytest.raises(SpecError) as e:
        parse_spec(text, "job.yaml")
    import re

    assert re.search(expected, str(e.value)), str(e.value)
    assert "Traceback" not in str(e.value)


def test_bad_task_path_and_yaml():
    with pytest.raises(SpecError, match="task.path.*package.module:function"):
        parse_spec(MINIMAL.replace("examples.tiny_lm:build", "not a path"))
    with pytest.raises(SpecError, match="not valid YAML"):
        parse_spec("name: [unclosed")
    with pytest.raises(SpecError, match="top level must be a mapping"):
        parse_spec("- a\n- b")


def test_cli_validate_schema_and_overrides(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(EXAMPLE)
    assert main(["validate", str(job), "--set", "train.grad_accum=8", "--set", "scaling.num_workers=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train"]["grad_accum"] == 8 and out["storage"].startswith("file:///")
    assert main(["validate", str(job), "--set", "train.grad_accum=0"]) == 2
    err = capsys.readouterr().err
    assert "train.grad_accum" in err and "Traceback" not in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the job file" in capsys.readouterr().err
    assert main(["validate", str(job), "--set", "novalue"]) == 2
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "train" in schema["properties"] and schema["additionalProperties"] is False
