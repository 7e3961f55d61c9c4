from syncpoint.policies.decisions.boundaries import (
    boundary_micro_steps,
    cycle_length,
    is_boundary,
    optimizer_steps_per_epoch,
    position_after,
)


def test_brief_example_steps_fire_after_4_8_10_14_18_20():
    assert boundary_micro_steps(4, 10, 2) == [4, 8, 10, 14, 18, 20]


def test_boundary_uses_position_within_epoch_not_global_counter():
    # global micro-step 12 is a multiple of 4 but position 2 of epoch 2: not a boundary
    assert not is_boundary(2, 4, 10)
    assert is_boundary(10, 4, 10) and is_boundary(4, 4, 10)


def test_short_cycle_length_and_steps_per_epoch():
    assert [cycle_length(p, 4, 10) for p in range(1, 11)] == [4] * 8 + [2, 2]
    assert cycle_length(3, 4, 8) == 4
    assert optimizer_steps_per_epoch(4, 10) == 3 and optimizer_steps_per_epoch(4, 8) == 2


def test_position_after_round_trips():
    p = position_after(14, 4, 10)
    assert (p.epoch, p.position_in_epoch, p.optimizer_step) == (1, 4, 4)
    p = position_after(20, 4, 10)
    assert (p.epoch, p.position_in_epoch, p.optimizer_step) == (1, 10, 6)
    assert position_after(0, 4, 10).optimizer_step == 0
