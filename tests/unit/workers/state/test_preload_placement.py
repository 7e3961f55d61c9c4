"""Which of DeepSpeed's reads may take a preloaded file (``syncpoint.workers.state.preload``): those
that ask for host memory, as the preload unpickled it; any other placement reads the file itself."""

from __future__ import annotations

import pytest
import torch

from syncpoint.workers.state.preload import host_placement


@pytest.mark.parametrize(
    "placement",
    ["cpu", torch.device("cpu"), lambda storage, loc: storage],
    ids=["'cpu'", "device cpu", "DeepSpeed's keep-the-storage lambda"],
)
def test_host_placements_take_a_preload(placement):
    assert host_placement(placement)


def _to_device(storage, loc):
    return storage.cuda()


@pytest.mark.parametrize(
    "placement",
    [None, "cuda:0", torch.device("cuda", 0), {"cuda:0": "cpu"}, _to_device, lambda storage, loc: None],
    ids=["None (where it was saved)", "'cuda:0'", "device cuda", "a mapping", "a function that moves", "another"],
)
def test_any_other_placement_reads_the_file_itself(placement):
    assert not host_placement(placement)


def test_a_function_with_a_closure_is_never_called():
    called = []

    def keep(storage, loc):
        called.append(loc)
        return storage

    assert not host_placement(keep) and not called
