"""Inside each Ray Train worker: the boundary-aware loop over DeepSpeed, data, RNG, the state
writer and reader, storage, the lease and events."""

from syncpoint.workers import deepspeed_import as _deepspeed_import  # noqa: F401 - before any DeepSpeed import
