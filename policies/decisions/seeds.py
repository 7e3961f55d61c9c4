"""Seeds derived from ``train.seed``: plain integers, no torch.

Why a module of its own: the job's ``PYTHONHASHSEED`` is needed where torch is not imported (the
driver, before ``ray.init``; a supervisor, which never trains), and importing ``syncpoint.workers.training.rng``
there would cost every worker group's start the seconds torch's import takes.
"""

from __future__ import annotations

import hashlib

# The part of a job's PYTHONHASHSEED that names it (derived from train.seed): never change it, or
# a restarted job would iterate its sets of strings in another order than before.
HASH_SEED_SALT = 0x4A54


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (no Python hash randomisation)."""
    digest = hashlib.blake2b(",".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def hash_seed(seed: int) -> int:
    """The job's ``PYTHONHASHSEED`` (every worker process and DataLoader worker), from ``train.seed``."""
    return derive_seed(seed, HASH_SEED_SALT) % 2**32
