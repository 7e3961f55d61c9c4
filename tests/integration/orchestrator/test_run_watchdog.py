"""The driver's watchdog (``syncpoint.orchestrator.run_watchdog``) without Ray: a driver that started it
and then a process that left its session and its parent (as a warm server does) is SIGKILLed after
its children got SIGTERM (what `ray job stop` does before its SIGKILL); the process it left behind
ends within seconds. Found by the marker this test sets, never by name (the whole
job: tests/ray/test_driver_signals.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ROOT, stop_processes
from tests.own_processes import marked_env, owned

DRIVER = """
import os, signal, subprocess, sys, time
from syncpoint.orchestrator import run_watchdog
run_watchdog.ensure()
if sys.argv[1:] == ["at-once"]:  # the signals a VM's shutdown or `ray job stop` sends, the moment it returned
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(run_watchdog._started.pid, sig)
# a grandchild in its own session whose parent exits at once: re-parented away from the driver
subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys; "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)"])
print("ready", flush=True)
time.sleep(600)
"""


def _left_behind(mark: str, driver: int) -> list[psutil.Process]:
    """The grandchild, once it runs (its parent starts it and exits)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = []
        for p in owned(mark):
            try:
                if p.pid != driver and "time.sleep(600)" in " ".join(p.cmdline()) and p.ppid() != driver:
                    found.append(p)
            except psutil.Error:
                continue
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("the left-behind process never ran")


@pytest.mark.parametrize(
    "signalled",
    # at-once: the watchdog signalled as soon as ensure() returned; it once died of a SIGTERM that came
    # while its interpreter was still starting (beside a busy process): ensure() now waits until it ignores them
    [pytest.param([], id="later"), pytest.param(["at-once"], id="at-once")],
)
def test_a_process_the_killed_driver_left_behind_ends_within_seconds(signalled):
    env, mark = marked_env(dict(os.environ))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, *signalled], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
        sleeper = _left_behind(mark, driver.pid)
        for child in psutil.Process(driver.pid).children():  # as `ray job stop` signals an entrypoint's children
            child.terminate()
        driver.kill()
        driver.wait()
        _, alive = psutil.wait_procs(sleeper, timeout=15)
        assert not alive
    finally:
        if driver.poll() is None:
            driver.kill()
        stop_processes(list(owned(mark)), mark=mark)
