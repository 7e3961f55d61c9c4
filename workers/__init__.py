"""Inside each Ray Train worker: the boundary-aware loop over DeepSpeed, data, RNG, the state
writer and reader, storage, the lease and events."""
