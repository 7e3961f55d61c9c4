"""Inside each training process: the user's task (``task``) and the sub-packages that run it:
``training`` (the loop and its pieces), ``supervision`` (starting, watching and recovering ranks),
``observation`` (events, progress, metrics, trackers), ``data``, ``state``, ``integrity``, ``storage``."""

from syncpoint.workers.training import deepspeed_import as _deepspeed_import  # noqa: F401 - before any DeepSpeed import
