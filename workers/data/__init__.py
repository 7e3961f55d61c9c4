"""The data position: the map-style sampler, sharded corpora, streams and their saved state,
and where the loop's micro-batches come from."""
