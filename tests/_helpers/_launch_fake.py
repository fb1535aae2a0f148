"""Stand-ins for cuLaunchKernel and the tensor-map encoders, for the CPU tests of prepared launches
(runtime.launch.PreparedLaunch, as scores_sm90 and pv_sm90 build them): the struct bytes a kernel would receive, its
launch dimensions and stream, and which maps were encoded again."""
import ctypes

import numpy as np


def blob(tag: int, ptr: int) -> np.ndarray:
    """A stand-in for the 128-byte CUtensorMap of layout `tag` at base `ptr`."""
    return np.frombuffer(np.array([tag, ptr] * 8, dtype=np.uint64).tobytes(), dtype=np.uint8)


class FakeKernel:
    """What a launch reads of a CuPy RawKernel: the shared-memory attribute and the CUfunction pointer."""
    max_dynamic_shared_size_bytes = 0

    def __init__(self, fn_ptr: int = 1234):
        self.kernel = type("Function", (), {"ptr": fn_ptr})()


class LaunchRecorder:
    """Patches cupy.cuda.driver.launchKernel: each launch is recorded as (fn_ptr, launch dims, stream, struct,
    extra), the struct read through kernelParams' one pointer as `params_dtype`; spec(tag) gives map layouts whose
    encodings are recorded as (tag, ptr) in ``encoded``."""

    def __init__(self, monkeypatch, params_dtype):
        from cupy.cuda import driver
        self.dtype, self.calls, self.encoded = params_dtype, [], []
        monkeypatch.setattr(driver, "launchKernel", self._launch)

    def _launch(self, fn_ptr, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        addr = ctypes.c_uint64.from_address(argv).value
        raw = bytes((ctypes.c_uint8 * self.dtype.itemsize).from_address(addr))
        self.calls.append((fn_ptr, (gx, gy, gz, bx, by, bz, smem), stream,
                           np.frombuffer(raw, dtype=self.dtype).reshape(()), extra))

    def spec(self, tag: int):
        recorder = self

        class Spec:
            def encode(self, ptr):
                recorder.encoded.append((tag, ptr))
                return blob(tag, ptr)
        return Spec()


def assert_same_struct(got: np.ndarray, want: np.ndarray) -> None:
    """Field by field (NumPy's copy leaves a struct's padding undefined)."""
    for name in want.dtype.names:
        assert got[name].tobytes() == want[name].tobytes(), name
