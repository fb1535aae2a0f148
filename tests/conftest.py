"""Shared test set-up: the ``gpu`` marker skips when no CUDA device is usable."""
import functools

import pytest


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
