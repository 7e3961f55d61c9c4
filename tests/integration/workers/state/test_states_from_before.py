"""A state written before the per-rank parts became a registry (``tests/fixtures/state_before_rank_parts``:
``tests.tasks:linear_user_state`` crashed at micro-step 9 by the code of 2026-12-06, its newest state at
micro-step 6, with its RNG, buffers and user files) still digests to what that code said and resumes:
the registry changed where the code lives, not a byte of the format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from syncpoint.policies.contracts.state_format import user_file
from syncpoint.workers.data.stream_state import parse_tree
from syncpoint.workers.state import user_state
from syncpoint.workers.storage import RunStorage
from tests.helpers import digest, linear_spec, run, state_names

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "state_before_rank_parts"


def _spec(run_dir: Path):
    return linear_spec(
        run_dir,
        "task.path=tests.tasks:linear_user_state",
        "task.config={num_samples: 32}",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.epochs=2",
        "checkpoint.save_every={value: 3, unit: micro_steps}",
    )


@pytest.mark.slow
def test_a_state_from_before_the_registry_digests_as_it_did_and_resumes(tmp_path):
    recorded = json.loads((FIXTURE / "digest.json").read_text())
    spec = _spec(tmp_path / "run")
    shutil.copytree(FIXTURE / "states", Path(spec.run_url.removeprefix("file://")) / "states")
    assert digest(spec, recorded["state"]) == recorded["digest"]

    assert run(spec).resumed_from == recorded["state"]
    final = state_names(spec)[-1]
    assert final > recorded["state"]
    data = RunStorage(spec.run_url).read_bytes("states", final, user_file(0), limit=1 << 20)
    objects = parse_tree(data, user_file(0), user_state.META_KEY, ("objects",), "user state")["objects"]
    assert sorted(objects) == ["ema", "scale"]
