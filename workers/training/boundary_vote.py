"""What the ranks agree on at every sync boundary, in one all-reduce.

Why a vote: some inputs differ between ranks (a preemption notice reaches one node, a wall-clock
trigger fires on one clock, one rank's upload finishes later, only rank 0 holds the lease), yet
every rank must take the same branch at the boundary or the next collective hangs. Each rank
casts its own vote; the sum is the same on every rank, and every decision reads the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BoundaryVote:
    """One rank's vote, or (after ``agree``) the sum over all ranks: each count says how many ranks."""

    # the micro-batch losses of this accumulation cycle (a rank's vote: a float64 tensor on its device, or a float)
    loss_sum: float | torch.Tensor
    preemption_notices: int = 0  # ranks told their node is going away
    wall_clock_saves: int = 0  # ranks whose wall-clock save trigger fired
    uploading: int = 0  # ranks whose asynchronous upload is still running
    lease_lost: int = 0  # rank 0's heartbeat found the run directory's lease taken over
    reports_due: int = 0  # ranks whose interval between reports to Ray Train has passed
    skipped_updates: int = 0  # ranks whose optimizer step DeepSpeed skipped (overflowing gradients)
    grace_saves: int = 0  # noticed ranks whose deadline is near or unknown: a save in the grace window is due
    stops: int = 0  # ranks the driver's own signal reached: save at this boundary, then the job stops

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        # float64 carries the loss sum and every count exactly (NCCL reduces
        # device tensors only, hence the device). The loss sum stays where it was computed: the
        # vote's one read on the host (``from_tensor``) is the cycle's only one.
        loss = torch.as_tensor(self.loss_sum, dtype=torch.float64, device=device).reshape(1)
        counts = [float(getattr(self, f.name)) for f in fields(self)[1:]]
        return torch.cat((loss, torch.tensor(counts, dtype=torch.float64, device=device)))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> BoundaryVote:
        loss_sum, *counts = tensor.tolist()
        if len(counts) != len(fields(cls)) - 1:
            raise ValueError(f"a boundary vote has {len(fields(cls))} slots, not {len(counts) + 1}")
        return cls(loss_sum, *(int(c) for c in counts))

    def agree(self, device: torch.device | str = "cpu") -> BoundaryVote:
        """The sum of every rank's vote (one collective): every rank gets the same result."""
        tensor = self.to_tensor(device)
        dist.all_reduce(tensor)
        return BoundaryVote.from_tensor(tensor)
