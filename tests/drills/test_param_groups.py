"""Parameter groups with the optimizer offloaded to the CPU resume exactly: DeepSpeed's CPU Adam, a
Task.optimizer's own CPU Adam, and a torch optimizer stepping the offloaded partitions."""

from __future__ import annotations

from tests.integration.workers.training.test_param_groups import TWO_GROUPS, _crash_and_resume


def test_offload_with_groups_resumes_exactly(tmp_path):
    """DeepSpeed's CPU Adam over the default split (equal betas), and a Task.optimizer's own CPU Adam
    with other betas per group (the kernel's beta powers replayed group by group after a load)."""
    _crash_and_resume(tmp_path / "a", 2, "deepspeed.offload_optimizer=cpu")
    _crash_and_resume(
        tmp_path / "b", 2, "deepspeed.offload_optimizer=cpu", TWO_GROUPS, "task.config.optimizer=cpu_adam"
    )


def test_offload_with_a_torch_task_optimizer_resumes_exactly(tmp_path):
    """A Task.optimizer that is not DeepSpeed's CPU Adam steps the offloaded partitions as it is."""
    _crash_and_resume(tmp_path, 2, "deepspeed.offload_optimizer=cpu", TWO_GROUPS)
