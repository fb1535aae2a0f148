"""Assertions on NVRTC compile reports (runtime.compile.VariantReport) shared by the kernel families' CPU tests."""


def assert_clean(reports, max_registers: int) -> None:
    """Every variant compiled with at most ``max_registers`` registers per thread at launch (168 for the Hopper
    kernels of 384 threads: their consumers' 240 after setmaxnreg is not in this report), no spills, no stack, and no
    ptxas performance warnings (C7514: serialized wgmma, which silently removes the overlap those kernels rely on)."""
    assert all(r.registers is not None and r.registers <= max_registers for r in reports), reports
    spilled = [(r.name_expression, r.spill_bytes, r.stack_bytes) for r in reports if r.spill_bytes or r.stack_bytes]
    assert not spilled, f"register spills / stack: {spilled}"
    warned = [(r.name_expression, r.perf_warnings) for r in reports if r.perf_warnings]
    assert not warned, f"ptxas performance warnings: {warned}"


def wgmma_gen():
    """tools/wgmma_gen.py, the generator of cuda_src/common/wgmma.cuh (outside the package): its tables of the wgmma
    widths a wrapper exists for, which the Hopper kernels' tests check their tiles against."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "wgmma_gen.py"
    spec = importlib.util.spec_from_file_location("wgmma_gen", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
