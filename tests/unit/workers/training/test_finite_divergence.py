"""The divergence streak (``syncpoint.workers.training.finite``): what counts, what ends a streak, what the
message names, and fp16's loss scaler finding its scale is no divergence."""

from __future__ import annotations

import math
from types import SimpleNamespace

from syncpoint.workers.training.finite import NonfiniteSteps, refused_save, scaler_calibrating


def _feed(steps: NonfiniteSteps, facts: list[tuple[float, bool, bool]]) -> list[str | None]:
    return [
        steps.observe(loss=loss, skipped=skipped, optimizer_step=i + 1, micro_step=4 * (i + 1), calibrating=cal)
        for i, (loss, skipped, cal) in enumerate(facts)
    ]


def test_a_streak_at_the_limit_stops_naming_its_first_step_and_a_finite_step_ends_it():
    nan = math.nan
    out = _feed(NonfiniteSteps(3), [(nan, False, False), (nan, False, False), (1.0, False, False)])
    assert out == [None, None, None]  # two, then a finite step: the streak starts over
    steps = NonfiniteSteps(3)
    out = _feed(steps, [(1.0, False, False), (nan, False, False), (2.0, True, False), (nan, True, False)])
    assert out[:3] == [None, None, None] and out[3] is not None
    assert "3 optimizer steps in a row" in out[3]
    assert "from optimizer step 2 (micro-step 8: loss nan)" in out[3] and "train.max_nonfinite_steps 3" in out[3]


def test_fp16s_scaler_finding_its_scale_neither_counts_nor_ends_a_streak():
    """40 skipped updates with a finite loss while the scaler can still lower its scale: no stop; at
    its minimum they count; a NaN loss counts even while it calibrates."""
    steps = NonfiniteSteps(10)
    assert _feed(steps, [(5.0, True, True)] * 40) == [None] * 40
    out = _feed(steps, [(5.0, True, False)] * 10)
    assert out[:9] == [None] * 9 and out[9] is not None and "update skipped (gradients overflowed" in out[9]
    steps = NonfiniteSteps(2)
    assert _feed(steps, [(math.nan, False, True), (math.inf, True, True)])[1] is not None


def test_only_a_dynamic_scaler_above_its_minimum_is_calibrating():
    def engine(scaler):
        return SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=scaler))

    assert scaler_calibrating(engine(SimpleNamespace(dynamic=True, cur_scale=2.0**16, min_scale=1)))
    assert not scaler_calibrating(engine(SimpleNamespace(dynamic=True, cur_scale=1.0, min_scale=1)))
    assert not scaler_calibrating(engine(SimpleNamespace(dynamic=False, cur_scale=1.0)))  # static (fp32 ZeRO)
    assert not scaler_calibrating(SimpleNamespace(optimizer=SimpleNamespace()))  # no scaler (ZeRO 0, fp32)


def test_a_non_finite_last_state_is_refused_naming_its_micro_step_and_the_remedy():
    text = str(refused_save(40))
    assert "the state at micro-step 40, the run's last, is not finite" in text
    assert "was not committed" in text and "train.gradient_clipping" in text


def test_all_finite_is_exact_for_every_floating_dtype_and_reads_shared_memory_once():
    import torch

    from syncpoint.workers.training.finite import all_finite

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for bad in (math.nan, math.inf, -math.inf):
            for at in (0, 4095, 123_456):
                t = torch.randn(200_000).to(dtype)
                t[at] = bad
                assert not all_finite([torch.ones(3), t]), (dtype, bad, at)
        assert all_finite([torch.randn(50_000).to(dtype), torch.empty(0), torch.tensor(2.0)])
    assert all_finite([torch.tensor([1, 2]), torch.zeros(2, dtype=torch.bool)])  # not floating: not read
    w = torch.randn(10)
    w[3] = math.nan
    assert not all_finite([w, w.detach(), w.view(2, 5)])
