"""The decisions, as plain functions over the data of the contracts: sync boundaries, candidate
classification and resume policies, retention, save triggers and intervals, elastic layouts,
evaluation, failure classification, goodput, redaction. No I/O, no Ray."""
