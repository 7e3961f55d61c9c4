"""``examples/own_training.yaml``: user state (an EMA, a loss-spike watch), a sampling callback and
MLflow together, on 2 ranks: crashed and resumed, it is the uninterrupted run (every step's loss,
the final digest with every rank's user state), its callback spoke, and MLflow holds one run."""

from __future__ import annotations

import pytest

from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
from syncpoint.workers.launch import run_spawned
from tests.helpers import ROOT, digest, state_names, step_history, with_overrides

EXAMPLE = (ROOT / "examples" / "own_training.yaml").read_text()


def _spec(storage):
    return resolve_storage(
        parse_spec(
            EXAMPLE,
            "examples/own_training.yaml",
            [
                f"storage={storage}",
                "task.config.seq_len=8",
                "task.config.num_samples=96",
                "task.config.eval_samples=8",
                "task.config.sample_every=2",
            ],
        )
    )


@pytest.mark.slow
def test_the_own_training_example_resumes_exactly_with_its_user_state_callback_and_mlflow(tmp_path, capfd):
    pytest.importorskip("mlflow")
    ref, resumed = _spec(tmp_path / "ref"), _spec(tmp_path / "resumed")
    assert run_spawned(ref) == [0, 0]
    assert run_spawned(with_overrides(resumed, "faults=[{at_micro_step: 7, mode: exit}]"))[0] == 17
    assert run_spawned(resumed) == [0, 0]
    final = state_names(ref)[-1]
    losses = [[s.loss for _, s in sorted(step_history(x).items())] for x in (ref, resumed)]
    assert losses[0] == losses[1] and digest(ref, final) == digest(resumed, final)
    out = capfd.readouterr().out
    assert "[example] step 2:" in out and out.count(", EMA ") == 2  # rank 0 alone, at the end of both runs
    runs = list((tmp_path / "resumed" / "own-training" / "mlruns").glob("*/*/meta.yaml"))
    assert len(runs) == 1, runs  # one MLflow run across both attempts
