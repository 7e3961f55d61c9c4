"""What the loop reads back from the device per micro-step: nothing of the loss.

Why: on a GPU every read of a tensor's value on the host (``float``, ``.item()``, ``.tolist()``)
waits for the work queued before it, so a read per micro-step keeps the host from queuing the next
micro-batch while the device still runs the backward. The loss is what the loop itself reads: its
sum over the cycle goes into the boundary vote, which is read once per optimizer step. The task's
loss here is a tensor subclass that counts every host read of it and of whatever is computed from
it (DeepSpeed's backward included), so the test holds on CPU as it would on a GPU."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from syncpoint.workers.task import Task
from tests.helpers import linear_spec, run
from tests.tasks import linear, mse

HOST_READS = {torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.item}
HOST_READS |= {torch.Tensor.tolist, torch.Tensor.numpy}


class CountedReads(torch.Tensor):
    """A tensor that counts host reads of itself and of every tensor computed from it."""

    reads: ClassVar[int] = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            CountedReads.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def counted_linear(config: dict) -> Task:
    """``tests.tasks.linear`` whose loss counts the host's reads of it."""
    task = linear(config)
    task.loss = lambda model, batch: mse(model, batch).as_subclass(CountedReads)
    return task


def test_the_loss_is_read_on_the_host_once_per_optimizer_step_not_per_micro_step(tmp_path):
    spec = linear_spec(
        tmp_path,
        f"task.path={__name__}:counted_linear",
        "task.config.num_samples=32",  # 32 micro-steps (micro-batch 1), accumulation 4: 8 optimizer steps
        "checkpoint.export_final=false",
    )
    CountedReads.reads = 0
    result = run(spec)
    assert (result.global_micro_step, result.optimizer_step) == (32, 8)
    # the boundary vote's read of the cycle's loss sum, once per optimizer step; it was once per micro-step more
    assert CountedReads.reads == result.optimizer_step
    # and the loss the loop records is the mean of the cycle's micro-batch losses, as before
    assert all(isinstance(r["loss"], float) for r in result.history)
