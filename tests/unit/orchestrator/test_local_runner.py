"""A local run's stop notice (``syncpoint.orchestrator.local_runner.LocalBoard``, read by
``syncpoint.workers.supervision.rank_process.driver_notice``): the driver marks it as it marks Ray's board,
each rank reads the signal's name; nothing else written there is a notice, and a link is not read."""

from __future__ import annotations

import os

from syncpoint.orchestrator.local_runner import STOP_FILE, LocalBoard
from syncpoint.workers.supervision.rank_process import driver_notice


def test_the_drivers_mark_is_each_ranks_notice_with_the_signals_name(tmp_path):
    notice = driver_notice(str(tmp_path / STOP_FILE))
    assert notice() is None  # no signal yet: one failed open a boundary
    LocalBoard(str(tmp_path)).stop.remote({"source": "driver", "signal": "SIGINT"})
    assert notice() == {"source": "driver", "signal": "SIGINT"}
    assert oct(os.stat(tmp_path / STOP_FILE).st_mode & 0o777) == "0o600"


def test_anything_else_there_is_no_notice_and_a_link_is_not_followed(tmp_path):
    stop = tmp_path / STOP_FILE
    stop.write_text("rm -rf /")
    assert driver_notice(str(stop))() is None
    stop.unlink()
    (tmp_path / "elsewhere").write_text("SIGTERM")
    stop.symlink_to(tmp_path / "elsewhere")
    assert driver_notice(str(stop))() is None
