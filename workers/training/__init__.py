"""The training loop and its pieces: the loop over DeepSpeed, what it carries between micro-steps,
the boundary vote, every rank's buffers and RNG, parameter groups, the schedule, evaluation, the
engine and its device, and the user's callbacks."""
