"""The DeepSpeed config a spec builds (``syncpoint.workers.training.engine.deepspeed_config``)."""

from __future__ import annotations

from syncpoint.workers.training.engine import deepspeed_config
from tests.helpers import linear_spec


def test_deepspeed_skips_its_per_save_tag_check_and_the_users_config_still_wins(tmp_path):
    """syncpoint saves under one constant tag, so DeepSpeed's check that every rank used the same one
    (two all-reduces on the loop at every save) is off; ``deepspeed.config`` overrides it as any key."""
    assert deepspeed_config(linear_spec(tmp_path))["checkpoint"] == {"tag_validation": "Ignore"}
    mine = linear_spec(tmp_path, "deepspeed.config={checkpoint: {tag_validation: Fail}}")
    assert deepspeed_config(mine)["checkpoint"] == {"tag_validation": "Fail"}
