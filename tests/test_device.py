"""Device placement helpers: batches follow the model, the backend follows the spec."""

from __future__ import annotations

from collections import namedtuple

import torch

from tests.helpers import linear_spec
from workers.device import backend, to_device

Pair = namedtuple("Pair", "x y")


def test_to_device_moves_every_tensor_and_keeps_the_structure():
    meta = torch.device("meta")  # a non-CPU device that needs no GPU
    batch = {"a": (torch.ones(2), [torch.zeros(1), 3]), "b": Pair(torch.ones(1), "label")}
    moved = to_device(batch, meta)
    assert moved["a"][0].device == meta and moved["a"][1][0].device == meta and moved["a"][1][1] == 3
    assert isinstance(moved["b"], Pair) and moved["b"].x.device == meta and moved["b"].y == "label"
    assert isinstance(moved["a"], tuple) and isinstance(moved["a"][1], list)


def test_cpu_batches_are_not_copied(tmp_path):
    t = torch.ones(3)
    assert to_device(t, torch.device("cpu")) is t


def test_backend_follows_use_gpu(tmp_path):
    assert backend(linear_spec(tmp_path)) == "gloo"
    assert backend(linear_spec(tmp_path, "scaling.use_gpu=true")) == "nccl"
