import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.filterwarnings("ignore")


def pytest_collection_modifyitems(config, items):
    """Tests that start a Ray cluster share one xdist worker (``xdist_group``), one after another.

    Why: two Ray clusters at once on a 2-core machine starve each other's nice-15 workers (timeouts
    that mean nothing), and module-scoped cluster fixtures stay shared only inside one worker. The
    rest of the suite runs on the other worker meanwhile (``make test`` uses ``--dist loadgroup``).
    """
    import pytest

    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
