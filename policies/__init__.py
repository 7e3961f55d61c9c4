"""Decisions as plain functions over metadata (spec, state format, boundaries, candidates, resume,
retention, save triggers, failures, goodput): no I/O, no Ray."""
