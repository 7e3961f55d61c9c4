"""``syncpoint.workers.data.function_identity``: a function's digest is the same in every process that
loads the same code, and changes when what it computes does (its body, its arguments, the plain
values and same-module helpers it reads); library code is named, not walked."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import pytest

from syncpoint.workers.data.function_identity import function_digest

MODULE = """
SCALE = {scale}
TABLE = {{"a": 1, "b": 2}}


def helper(x):
    return x + {helper_add}


def double(example):
    return {{"x": helper(example["x"]) * SCALE}}


def make_closure(k):
    def inner(example):
        return {{"x": example["x"] + k}}
    return inner


class Tokenize:
    def __call__(self, example):
        return {{"x": example["x"] - {call_sub}}}
"""

PROBE = """
import functools, json, sys
sys.path.insert(0, sys.argv[1])
import task_mod as m
from syncpoint.workers.data.function_identity import function_digest
print(json.dumps({
    "double": function_digest(m.double),
    "closure": function_digest(m.make_closure(3)),
    "partial": function_digest(functools.partial(m.double)),
    "callable": function_digest(m.Tokenize()),
    "lambda": function_digest(lambda ex: m.double(ex)),
}))
"""


def _digests(folder, **values) -> dict[str, str]:
    """Each probe's digest, computed in a fresh interpreter over a module written with ``values`` in ``folder``."""
    folder.mkdir()
    params = {"scale": 3, "helper_add": 1, "call_sub": 1, **values}
    (folder / "task_mod.py").write_text(textwrap.dedent(MODULE.format(**params)))
    out = subprocess.run([sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.slow
def test_the_digest_is_the_same_in_two_processes_and_changes_with_what_the_function_computes(tmp_path):
    first = _digests(tmp_path / "first")
    assert _digests(tmp_path / "same") == first  # another interpreter, the same code (elsewhere): the same digests
    scaled = _digests(tmp_path / "scaled", scale=4)  # a module-level value double reads
    assert scaled["double"] != first["double"] and scaled["partial"] != first["partial"]
    assert scaled["closure"] == first["closure"] and scaled["callable"] == first["callable"]
    helped = _digests(tmp_path / "helped", helper_add=2)  # a same-module helper's body
    assert helped["double"] != first["double"]
    assert helped["lambda"] == first["lambda"]  # the lambda is __main__'s: another module's functions are named only
    called = _digests(tmp_path / "called", call_sub=2)  # a callable object's __call__
    assert called["callable"] != first["callable"] and called["double"] == first["double"]


def test_closure_values_defaults_and_partial_arguments_are_part_of_the_digest():
    def make(k):
        return lambda ex: ex + k

    assert function_digest(make(1)) == function_digest(make(1))
    assert function_digest(make(1)) != function_digest(make(2))

    def with_default(ex, k=1):
        return ex + k

    def with_other_default(ex, k=2):
        return ex + k

    assert function_digest(with_default) != function_digest(with_other_default)
    assert function_digest(functools.partial(with_default, k=1)) != function_digest(
        functools.partial(with_default, k=3)
    )
    assert function_digest(with_default, {"batched": True}) != function_digest(with_default, {"batched": False})


def test_library_code_is_named_not_walked_and_objects_without_code_by_their_type():
    """A library function (here json.dumps) and an arbitrary object digest by name: stable, cheap,
    not refused after a library upgrade."""
    assert function_digest(json.dumps) == function_digest(json.dumps)
    assert function_digest(json.dumps) != function_digest(json.loads)
    assert len(function_digest(object())) == 16

    def reads_a_recursive_value(ex):
        return reads_a_recursive_value  # a function reading itself: walked once

    assert len(function_digest(reads_a_recursive_value)) == 16
