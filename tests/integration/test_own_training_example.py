"""``examples/own_training.yaml``: user state (an EMA, a loss-spike watch), a sampling callback and
MLflow together, on 2 ranks: crashed and resumed, it is the uninterrupted run (every step's loss,
the final digest with every rank's user state), its callback said what the uninterrupted one's
said, and MLflow holds one run."""

from __future__ import annotations

import pytest

from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import ROOT, digest, state_names, step_history, with_overrides

EXAMPLE = (ROOT / "examples" / "own_training.yaml").read_text()


def _spec(storage, samples_to):
    overrides = ["task.config.seq_len=8", "task.config.num_samples=96", "task.config.eval_samples=8"]
    overrides += ["task.config.sample_every=2", f"task.config.samples_to={samples_to}"]
    return resolve_storage(parse_spec(EXAMPLE, "examples/own_training.yaml", [f"storage={storage}", *overrides]))


@pytest.mark.slow
def test_the_own_training_example_resumes_exactly_with_its_user_state_callback_and_mlflow(tmp_path):
    """6 optimizer steps (3 micro-batches of 2 per epoch, 2 epochs), a state at step 4 (micro-step 8);
    the crash at micro-step 11 loses step 6's first half."""
    pytest.importorskip("mlflow")
    ref = _spec(tmp_path / "ref", tmp_path / "ref.txt")
    resumed = _spec(tmp_path / "resumed", tmp_path / "resumed.txt")
    assert run_spawned(ref) == [0, 0]
    assert run_spawned(with_overrides(resumed, "faults=[{at_micro_step: 11, mode: exit}]"))[0] == 17
    assert run_spawned(resumed) == [0, 0]
    final = state_names(ref)[-1]
    losses = [[s.loss for _, s in sorted(step_history(x).items())] for x in (ref, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 6 and digest(ref, final) == digest(resumed, final)
    said = [(tmp_path / f).read_text().splitlines() for f in ("ref.txt", "resumed.txt")]
    # rank 0 alone: text sampled at steps 2, 4 and 6 (step 6 by the resumed attempt), then the EMA's loss
    assert [x.split(":")[0] for x in said[0][:3]] == ["[example] step 2", "[example] step 4", "[example] step 6"]
    assert len(said[0]) == 4 and said[0][3].startswith("[example] eval_loss ")
    assert said[0] == said[1]  # the same samples and the same EMA loss: the draws were shielded, the EMA restored
    runs = list((tmp_path / "resumed" / "own-training" / "mlruns").glob("*/*/meta.yaml"))
    assert len(runs) == 1, runs  # one MLflow run across both attempts
