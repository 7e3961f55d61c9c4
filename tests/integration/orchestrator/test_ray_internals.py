"""Every private name of Ray's that syncpoint uses (``syncpoint.orchestrator.ray_internals``) resolves
against the installed Ray, which is the version the module is written for: a Ray upgrade that moves
one fails here, with its name, instead of in a user's run."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import ray

from syncpoint.orchestrator import ray_internals


def test_the_installed_ray_is_the_one_the_adapter_is_written_for():
    assert ray.__version__.startswith(ray_internals.WRITTEN_FOR + "."), ray.__version__


@pytest.mark.parametrize("name", sorted(ray_internals.NAMES))
def test_every_private_name_resolves(name):
    from_module, attribute = ray_internals.NAMES[name]
    module = importlib.import_module(from_module)
    assert getattr(ray_internals, name) is (module if attribute is None else getattr(module, attribute))


@pytest.mark.parametrize("module", ray_internals.MODULE_NAMES)
def test_every_private_module_named_exists(module):
    assert importlib.util.find_spec(module) is not None, module


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_of_rays'"):
        ray_internals.nothing_of_rays  # noqa: B018 - the lookup is the test


def test_the_adapter_exports_every_name_it_resolves():
    constants = {
        "WRITTEN_FOR",
        "NAMES",
        "MODULE_NAMES",
        *(n for n in dir(ray_internals) if n.endswith(("_LOGGER", "_MODULE"))),
    }
    assert set(ray_internals.__all__) == set(ray_internals.NAMES) | constants
