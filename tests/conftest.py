"""Shared test set-up: the ``gpu`` marker skips when no CUDA device is usable; the shared helpers (tests/_helpers/:
float64 references, the tolerance rule, compile checks, launch fakes and recorders) are importable by name."""
import functools
import pathlib
import sys

import pytest

_HELPERS = str(pathlib.Path(__file__).resolve().parent / "_helpers")
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, or CuPy missing: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
