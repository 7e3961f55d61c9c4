"""The messages the CLI's process quiets (the mechanism: ``syncpoint.workers.log_filters``); the
driver (``syncpoint.orchestrator.ray_runner``) and every Ray worker process of a job
(``syncpoint.orchestrator.worker_setup``) use ``drop`` from here too."""

from __future__ import annotations

from syncpoint.workers.log_filters import drop

# DeepSpeed logs (its "DeepSpeed" logger, warning) whenever it is imported without DS_ACCELERATOR on a
# machine without a GPU. The CLI's own process (digest, the drill's comparison) imports it to read
# states, which needs no accelerator; the workers are told which one (ray_runner.quiet_worker).
ACCELERATOR_LINE = r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to detect it\.$"


def quiet_cli() -> None:
    """In the CLI's process, before anything imports DeepSpeed."""
    drop("DeepSpeed", ACCELERATOR_LINE)
