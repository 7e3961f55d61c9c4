"""Observation: the run's event log, progress records, metric sinks, experiment trackers, and whose
output reaches the user."""
