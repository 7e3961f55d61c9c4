"""``scaling.env``: the job's environment variables. Validated (names a shell takes, none syncpoint
sets per rank, string values), given to every Ray Train worker through its runtime_env and to the
spawned ranks of a run without Ray, and never printed or stored with a secret-named variable's
value. A worker on a `ray start` cluster seeing it is ``tests/drills/ray/test_ray_start_sigterm.py``; the
rendered pods carrying it, ``tests/k8s/test_k8s_user.py``."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from syncpoint.policies.contracts.errors import SpecError
from syncpoint.policies.contracts.spec import MAX_ENV_VARS, ScalingSpec, spec_to_json
from tests.helpers import cli, linear_spec

SECRET = "hunter2-3f9a-never-shown"


def test_names_and_values_are_normalized():
    env = ScalingSpec.model_validate({"env": {"DATA_DIR": "/data/owt", "_N": 3, "RATIO": 0.5, "EMPTY": ""}}).env
    assert env == {"DATA_DIR": "/data/owt", "_N": "3", "RATIO": "0.5", "EMPTY": ""}
    assert ScalingSpec().env == {}


@pytest.mark.parametrize(
    "env,says",
    [
        ({"1DIR": "x"}, "'1DIR' is not an environment variable name"),
        ({"DATA-DIR": "x"}, "is not an environment variable name"),
        ({"A" * 129: "x"}, "at most 128 characters"),
        ({"PYTHONHASHSEED": "1"}, "PYTHONHASHSEED is syncpoint's to set for every rank (from train.seed"),
        ({"RANK": "1"}, "torch.distributed's"),
        ({"PYTHONPATH": "/x"}, "set it where `syncpoint run` runs"),
        ({"FLAG": True}, "quote it (FLAG: 'true')"),
        ({"LIST": [SECRET]}, "LIST: a value must be a string, not a list"),
        ({"NUL": "a\x00b"}, "no NUL character"),
        ({f"V{i}": "x" for i in range(MAX_ENV_VARS + 1)}, f"at most {MAX_ENV_VARS} variables"),
        (SECRET, "must be a mapping of NAME: value"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(env, says):
    with pytest.raises(ValidationError) as e:
        ScalingSpec.model_validate({"env": env})
    assert says in str(e.value)


def test_the_cli_refuses_a_bad_name_in_one_paragraph_without_echoing_a_value(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: j\ntask: {path: tests.light_tasks:linear}\ntrain: {micro_batch_size: 1, epochs: 1}\n"
        "scaling:\n  env: {GOOD: x, 9BAD: y}\n"
    )
    rc, out, err = cli(capsys, "validate", str(job))
    assert rc == 2 and out == ""
    assert "scaling.env (line 5): '9BAD' is not an environment variable name" in err
    assert "\n\n" not in err.strip()
    rc, _, err = cli(capsys, "validate", str(job), "--set", f"scaling.env={SECRET}")
    assert rc == 2 and "must be a mapping" in err and SECRET not in err


def test_printed_and_stored_specs_mask_secret_named_values(tmp_path, capsys):
    env = {"DATA_DIR": "/data/owt", "WANDB_API_KEY": SECRET, "HF_TOKEN": SECRET, "SRC": f"s3://AK:{SECRET}@b/x"}
    spec = linear_spec(tmp_path, f"scaling.env={json.dumps(env)}")
    shown = json.loads(spec_to_json(spec))["scaling"]["env"]
    assert shown == {"DATA_DIR": "/data/owt", "WANDB_API_KEY": "***", "HF_TOKEN": "***", "SRC": "s3://***@b/x"}
    assert json.loads(spec_to_json(spec, redact=False))["scaling"]["env"] == env  # what the workers get
    job = tmp_path / "job.yaml"
    job.write_text(spec_to_json(spec, redact=False))
    rc, out, err = cli(capsys, "validate", str(job))
    assert rc == 0 and SECRET not in out + err and '"DATA_DIR": "/data/owt"' in out


def test_every_ray_train_worker_and_every_spawned_rank_gets_the_env(tmp_path):
    from syncpoint.orchestrator.ray_runner import worker_runtime_env

    spec = linear_spec(tmp_path, "scaling.env={DATA_DIR: /data/owt, HF_TOKEN: t}")
    env_vars = worker_runtime_env(spec)["env_vars"]
    assert env_vars["DATA_DIR"] == "/data/owt" and env_vars["HF_TOKEN"] == "t" and "PYTHONHASHSEED" in env_vars


def test_a_submission_refuses_a_secret_named_variable(tmp_path):
    """Through the Ray Job API the job file and the workers' runtime_env are readable: the cluster's
    own environment is where a credential belongs."""
    from syncpoint.orchestrator.submit import refuse_url_credentials

    refuse_url_credentials(linear_spec(tmp_path, "scaling.env={DATA_DIR: /data}"))
    with pytest.raises(SpecError) as e:
        refuse_url_credentials(linear_spec(tmp_path, f"scaling.env={{WANDB_API_KEY: {SECRET}}}"))
    assert "scaling.env WANDB_API_KEY" in str(e.value) and SECRET not in str(e.value)
