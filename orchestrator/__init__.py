"""The driver: the CLI, the Ray wiring, the failure policy, drills, storms and the timeline."""
