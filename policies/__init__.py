"""The leaves: ``contracts`` (the job spec, the state format, the event log's typed events, the
errors, reading user code and stored JSON) and ``decisions`` (plain functions over that data:
boundaries, candidates and resume, retention, save triggers, failures, goodput). No I/O, no Ray."""
