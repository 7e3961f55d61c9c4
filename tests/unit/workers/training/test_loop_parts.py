"""The loop's parts on their own: the boundary vote, preemption notices, the position, the seeds.

Why separately: the equivalence grids prove the loop end to end, but a regression in one of these
(a vote slot read as another, a SIGTERM no longer heard, a salt renumbered) would show there only
as an unexplained mismatch; here it fails with its own name.
"""

from __future__ import annotations

import signal
import threading

import pytest
import torch

from syncpoint.policies.contracts.spec import TrainSpec
from syncpoint.policies.decisions.elastic import layout
from syncpoint.workers.data import sampler
from syncpoint.workers.supervision.faults import Faults
from syncpoint.workers.supervision.launch import ensure_single_process_group
from syncpoint.workers.supervision.preemption import PreemptionNotices
from syncpoint.workers.training import rng
from syncpoint.workers.training.boundary_vote import BoundaryVote
from syncpoint.workers.training.position import RunLength, TrainingPosition


def test_a_vote_goes_through_a_tensor_and_back_slot_by_slot():
    vote = BoundaryVote(
        1.25,
        preemption_notices=1,
        wall_clock_saves=0,
        uploading=1,
        lease_lost=0,
        reports_due=1,
        skipped_updates=1,
        grace_saves=1,
        stops=1,
    )
    tensor = vote.to_tensor()
    assert tensor.dtype == torch.float64 and tensor.tolist() == [1.25, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert BoundaryVote.from_tensor(tensor) == vote
    with pytest.raises(ValueError, match="9 slots, not 4"):
        BoundaryVote.from_tensor(torch.zeros(4, dtype=torch.float64))


def test_agreeing_sums_the_ranks_votes():
    ensure_single_process_group("gloo")  # the in-process launcher's group, shared with other tests
    agreed = BoundaryVote(0.1 + 0.2, preemption_notices=1, lease_lost=1).agree()
    assert agreed == BoundaryVote(0.1 + 0.2, 1, 0, 0, 1, 0)  # the loss sum is carried bit for bit


def test_the_cycle_loss_sum_stays_a_tensor_and_agrees_bit_for_bit_with_the_python_float_sum():
    """The loop adds each micro-batch's loss on its device (no host read per micro-step,
    tests/integration/workers/training/test_loop_host_syncs.py); the vote reads the sum once. It must be the value
    the loop computed before, Python floats added in order, bit for bit, whatever the losses."""
    from syncpoint.workers.training.finite import NonfiniteSteps
    from syncpoint.workers.training.loop_state import LoopState

    losses = torch.randn(64, generator=torch.Generator().manual_seed(5)).float().exp() * 3.7
    state = LoopState(at=TrainingPosition(), nonfinite=NonfiniteSteps(0))
    expected = 0.0
    for loss in losses:
        state.add_loss(loss)
        expected += float(loss)
    assert isinstance(state.cycle_loss_sum, torch.Tensor) and state.cycle_loss_sum.dtype == torch.float64
    ensure_single_process_group("gloo")
    agreed = BoundaryVote(state.cycle_loss_sum, preemption_notices=1).agree()
    assert agreed == BoundaryVote(expected, 1) and float(state.cycle_loss_sum).hex() == expected.hex()
    state.new_cycle()
    assert state.cycle_loss_sum == 0.0


def test_sigterm_is_a_notice_while_listening_and_the_old_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append("previous"))
    try:
        notices = PreemptionNotices()
        assert notices.poll() is None
        notices.listen_for_sigterm()
        signal.raise_signal(signal.SIGTERM)
        assert notices.poll() == {"source": "sigterm"} and seen == []
        notices.stop_listening()
        signal.raise_signal(signal.SIGTERM)
        assert seen == ["previous"]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_rays_notice_wins_and_fault_injection_only_sends_a_sigterm(tmp_path):
    from syncpoint.workers.storage import RunStorage

    notices = PreemptionNotices(lambda: {"source": "ray", "node": "n1"})
    faults = Faults([], RunStorage(f"file://{tmp_path}"), 0, send_sigterm=notices.send_sigterm)
    faults.send_sigterm()  # not listening (as off the main thread): recorded as the handler would
    assert notices.sigterm_received
    assert notices.poll() == {"source": "ray", "node": "n1"}


def test_off_the_main_thread_there_is_no_handler_to_install():
    notices = PreemptionNotices()
    before = signal.getsignal(signal.SIGTERM)
    worker = threading.Thread(target=notices.listen_for_sigterm)
    worker.start()
    worker.join()
    assert signal.getsignal(signal.SIGTERM) is before
    notices.send_sigterm()
    assert notices.poll() == {"source": "sigterm"}


def test_the_grace_window_opens_once():
    notices = PreemptionNotices()
    assert not notices.agreed(0) and not notices.in_grace_window
    assert notices.agreed(2) and notices.in_grace_window  # the boundary where the ranks first agree
    assert not notices.agreed(1) and not notices.agreed(0) and notices.in_grace_window


def test_position_and_run_length():
    train = TrainSpec(epochs=2, micro_batch_size=1, grad_accum=4)
    length = RunLength.of(train, layout(10, 1, 4, 1))  # 10 micro-batches per epoch: steps at 4, 8, 10
    assert length.total_steps == 6 and length.schedule_horizon == 6
    at = TrainingPosition()
    for _ in range(10):
        at.consume_micro_batch(1)
    at.optimizer_stepped("optimizer_steps")
    assert (at.position_in_epoch, at.global_micro_step, at.global_samples, at.optimizer_step, at.schedule_position) == (
        10,
        10,
        10,
        1,
        1,
    )
    assert not length.is_last_boundary(at, epoch_end=True)
    at.next_epoch()
    assert (at.epoch, at.position_in_epoch) == (1, 0) and length.is_last_boundary(at, epoch_end=True)
    assert length.reached(TrainingPosition(epoch=2)) and length.reached(TrainingPosition(optimizer_step=6))
    assert not length.reached(TrainingPosition(epoch=1, optimizer_step=5))


def test_the_seeds_are_the_ones_old_states_were_written_with():
    """Named salts, same numbers: renumbering one would silently change every resumed run's data."""
    assert (
        sampler.EPOCH_PERMUTATION_SALT,
        sampler.COLLATE_SALT,
        sampler.DATALOADER_GENERATOR_SALT,
        rng.RESIZED_WORLD_SALT,
    ) == (
        0x5EED,
        0xC011A7E,
        0xDA7A,
        0xE1A5,
    )
    assert rng.derive_seed(7, 3, 0x5EED) == 1819681313992698199
    assert rng.derive_seed(1, 10, 2, 0xE1A5) == 2488416431689574933
