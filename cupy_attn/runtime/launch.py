"""Kernel launches: a call's launch prepared once, replayed on new pointers by one driver call per kernel.

Every kernel of the package takes one argument, a by-value parameter struct declared once as a NumPy structured
dtype (KernelFamily.structs checks it against the C++ struct when the family compiles). A launcher fills the struct
with everything that depends on shapes, strides, dtypes and flags, and declares what a replay writes into it; a
:class:`PreparedLaunch` keeps its own copy of the bytes and, per replay, writes

- pointer slots: fields set to an argument's address, or to an address plus a fixed byte offset (regions of a scratch
  buffer passed as one argument);
- tensor-map slots (:class:`Maps`, runtime.tma): 128-byte CUtensorMaps encoded from arguments' addresses, encoded
  again only when an address moved (a replay on the same arrays encodes nothing: ~4 µs a map otherwise), copied into
  the struct only when they changed;
- flag slots (:class:`AlignFlag`): a field whose bits depend on an argument's alignment (16-byte copies, TMA stores);
- a scratch slot (:class:`Scratch`): a per-call buffer allocated by the replay (decode's partials), the addresses of
  its regions written into fields, held until the kernels are enqueued;

then launches its :class:`Step` s, one cuLaunchKernel (or cuLaunchKernelEx: programmatic dependent launch) each, all
on the one struct (decode's split and combine kernels; Linear-BN-softmax's statistics and row kernels). The driver
copies the struct during each call, so the next replay may rewrite it at once; a lock keeps two threads replaying
one launch from interleaving their writes. A replay costs about 1 µs of host time per kernel (a few word writes and
the driver call; no allocation, no dict or ctypes struct built), against ~6 µs through CuPy's RawKernel call with a
per-call copy of the struct. The replay is a function written out for the launch's slots, e.g. FA3's::

    def launch_on(_stream, q=0, k=0, v=0, out=0, lse=0, mask=0):
        if mask:
            raise ValueError(_refuse[0])
        with _lock:
            _words[64] = out
            _words[65] = lse
            _words[82] = _c0 if out % _c1 == 0 else _c2
            _maps0.write(q, k, v)
            _maps1.write(out)
            _launch0(_fn0, _gx0, _gy0, _gz0, _bx0, _by0, _bz0, _smem0, _stream, _argv0, 0)

:meth:`PreparedLaunch.bind` gives the call cache its replay callable ``run(*pointers)`` on one stream; nothing in a
replay synchronizes or allocates outside a scratch slot's allocator, so it may be captured into a CUDA graph.
:func:`launch_struct` launches a kernel once on a struct (schedules whose parameters change per launch, benchmarks).
"""
from __future__ import annotations

import dataclasses
import functools
import keyword
import sys
import threading
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .tma import TensorMaps


@dataclasses.dataclass(frozen=True)
class Step:
    """One kernel of a launch: the loaded kernel (a ``cupy.RawKernel``; KernelFamily's memo keeps its module alive),
    grid, block, dynamic shared memory in bytes, ``pdl`` (launched as a programmatic dependent of the kernel before
    it in the stream: it may start while that one drains and must wait, ``griddepcontrol.wait``, before reading its
    output; check :func:`pdl_supported`) and the byte offset in the launch's struct of the struct this kernel takes
    (0: all of it; decode's combine kernel reads the FlashDecodeParams inside FlashDecodeSm90Params)."""
    kernel: Any
    grid: tuple
    block: tuple
    smem: int = 0
    pdl: bool = False
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class Maps:
    """Tensor maps written per replay: struct field ``fields[i]`` (a 128-byte CUtensorMap) holds ``encoders[i]``
    (an address -> the map's 128 bytes, e.g. tma.MapSpec.encode) at the address of ``args[i]`` (an argument name, or
    (name, byte offset)). The group is encoded again when any of its addresses moved. ``align``: a replay whose first
    address is not a multiple of it leaves the maps as they are (FA3's out map, stored by TMA only from a 16-byte
    aligned base; an AlignFlag tells the kernel)."""
    fields: tuple
    args: tuple
    encoders: tuple
    align: int = 1


@dataclasses.dataclass(frozen=True)
class AlignFlag:
    """Field ``field`` (8 bytes) gets ``bits`` or'ed into its prepared value when argument ``arg``'s address is a
    multiple of ``align``, its prepared value otherwise."""
    field: str
    arg: str
    align: int
    bits: int


@dataclasses.dataclass(frozen=True)
class Scratch:
    """A per-replay buffer: ``alloc()`` -> (holder, base address), called under the launch's lock; ``fields`` maps
    struct fields to byte offsets from the base. The holder is kept until the launch's kernels are enqueued (a
    stream-ordered allocator may then reuse the memory after them)."""
    alloc: Callable[[], tuple]
    fields: Mapping[str, int]


class ParamBuffer:
    """A launch's own copy of its struct: ``bytes`` (uint8), ``words`` (the same memory as uint64), ``lock``, and
    :meth:`argv`, cuLaunchKernel's kernelParams (a one-pointer array) for the struct at a byte offset. ``params``: a
    0-d structured NumPy array whose size is a multiple of 8 bytes."""

    __slots__ = ("bytes", "words", "lock", "_argv")

    def __init__(self, params: np.ndarray):
        if params.dtype.itemsize % 8:
            raise ValueError(f"parameter struct of {params.dtype.itemsize} bytes: a multiple of 8 is needed")
        self.bytes = params.reshape(1).view(np.uint8).copy()
        self.words = self.bytes.view(np.uint64)
        self.lock = threading.Lock()
        self._argv: dict = {}

    def argv(self, offset: int = 0) -> int:
        """The address of a kernelParams array holding the address of ``bytes[offset:]`` (kept with the buffer)."""
        a = self._argv.get(offset)
        if a is None:
            a = self._argv[offset] = np.array([self.bytes.ctypes.data + offset], dtype=np.uint64)
        return int(a.ctypes.data)


@functools.lru_cache(maxsize=1024)
def _word_index(dtype: np.dtype, name: str) -> int:
    """The index of an 8-byte integer field among the struct's 64-bit words; ValueError for other fields."""
    off, size = field_offset(dtype, name)
    if size != 8 or off % 8:
        raise ValueError(f"field {name!r} ({size} bytes at offset {off}) is not one aligned 8-byte word")
    return off // 8


def field_offset(dtype: np.dtype, name: str) -> tuple[int, int]:
    """(byte offset, size) of a field of a structured dtype; ``"p.out"`` names field ``out`` of nested struct ``p``.

    >>> field_offset(np.dtype([("a", np.int64), ("p", [("x", np.int32), ("y", np.float64)])]), "p.y")
    (12, 8)
    """
    offset = 0
    for part in name.split("."):
        if dtype.names is None or part not in dtype.names:
            raise KeyError(f"no field {name!r} in the parameter struct")
        sub, off = dtype.fields[part][:2]
        offset, dtype = offset + off, sub
    return offset, dtype.itemsize


class _MapSlots:
    """A Maps group bound to a launch's bytes (written under the launch's lock): ``write(*addresses)``."""

    __slots__ = ("_maps", "_bytes", "_offsets", "_align", "_written", "bases")

    def __init__(self, spec: Maps, own: ParamBuffer, dtype: np.dtype):
        if not len(spec.args) == len(spec.encoders) == len(spec.fields):
            raise ValueError("Maps: one argument and one encoder per field")
        self._maps = TensorMaps(spec.encoders)
        self._bytes = own.bytes
        offsets = []
        for name in spec.fields:
            off, size = field_offset(dtype, name)
            if size != 128:
                raise ValueError(f"tensor-map field {name!r} is {size} bytes, not 128")
            offsets.append(off)
        self._offsets = tuple(offsets)
        self._align = spec.align
        self._written = None
        self.bases = tuple((a, 0) if isinstance(a, str) else tuple(a) for a in spec.args)  # (argument, offset)

    def write(self, *bases: int) -> None:
        if bases[0] % self._align:
            return
        maps = self._maps(*bases)
        if maps is not self._written:
            for off, m in zip(self._offsets, maps):
                self._bytes[off:off + 128] = m
            self._written = maps


class PreparedLaunch:
    """One call's kernels on their parameter struct, everything but the call's addresses prepared.

    params:   the struct (0-d structured array) as prepared; copied, never written by a replay (``params`` keeps it).
    steps:    the kernels (:class:`Step`), launched in order on the struct per replay.
    args:     the replay's argument names, in order (``launch_on(stream, *addresses)``; identifiers not starting with
              an underscore); trailing ones left out are 0.
    pointers: struct field -> argument name, or (argument name, byte offset): written per replay.
    maps, flags, scratch: tensor-map groups (:class:`Maps`), :class:`AlignFlag` s, a :class:`Scratch` slot.
    refuse:   argument name -> message: a replay with a nonzero address for it raises ValueError(message).
    info:     what the launcher chose, for explain-style descriptions and tests (tile, variant, choice...).

    The replay, ``launch_on``, is a function written for the declared slots (``replay_source`` shows it): the word
    writes, map writes and driver calls of this launch and nothing else, with the arguments as parameters (a generic
    loop over the slots cost ~0.3 µs more per replay, a third of the whole). Launches of one layout share it (compiled
    once per process). The kernels' device must be current at a replay (the call cache enters the call's context when
    it is not).
    """

    def __init__(self, params: np.ndarray, steps: Sequence[Step], *, args: Sequence[str] = (),
                 pointers: Mapping[str, Any] | None = None, maps: Sequence[Maps] = (),
                 flags: Sequence[AlignFlag] = (), scratch: Scratch | None = None,
                 refuse: Mapping[str, str] | None = None, info: Mapping[str, Any] | None = None):
        self.params = params
        self.steps = tuple(steps)
        self.args = tuple(args)
        self.info = dict(info or {})
        for name in self.args:
            if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
                raise ValueError(f"argument name {name!r}: an identifier not starting with an underscore")
        if len(set(self.args)) != len(self.args):
            raise ValueError(f"argument names repeat: {self.args}")
        dtype = params.dtype
        own = self._own = ParamBuffer(params)

        def word(name: str) -> int:
            off, size = field_offset(dtype, name)
            if size != 8 or off % 8:
                raise ValueError(f"field {name!r} ({size} bytes at offset {off}) is not one aligned 8-byte word")
            return off // 8

        def arg(name: str) -> str:
            if name not in self.args:
                raise KeyError(f"{name!r} is not one of the arguments {self.args}")
            return name

        consts: list = []  # numbers that vary between launches of one layout: closure variables, not literals

        def const(value: int) -> str:
            consts.append(value)
            return f"_c{len(consts) - 1}"

        def address(name: str, off: int) -> str:
            return f"{arg(name)} + {const(off)}" if off else arg(name)

        body = [f"        _words[{word(f)}] = {address(*((a, 0) if isinstance(a, str) else a))}"
                for f, a in (pointers or {}).items()]
        for f in flags:
            w = word(f.field)
            value = int(own.words[w])
            body.append(f"        _words[{w}] = {const(value | f.bits)} if {arg(f.arg)} % {const(f.align)} == 0 "
                        f"else {const(value)}")
        if scratch is not None:
            body.append("        _held, _base = _alloc()")
            body += [f"        _words[{word(f)}] = _base" + (f" + {const(off)}" if off else "")
                     for f, off in scratch.fields.items()]
        slots = tuple(_MapSlots(m, own, dtype) for m in maps)
        body += [f"        _maps{j}.write({', '.join(address(a, off) for a, off in m.bases)})"
                 for j, m in enumerate(slots)]
        resolved = []
        for j, s in enumerate(self.steps):
            if s.smem and s.kernel.max_dynamic_shared_size_bytes < s.smem:
                s.kernel.max_dynamic_shared_size_bytes = s.smem
            resolved.append((launcher(s.pdl), int(s.kernel.kernel.ptr), *_dims(s.grid, s.block, s.smem),
                             own.argv(s.offset)))
            body.append(f"        _launch{j}(_fn{j}, _gx{j}, _gy{j}, _gz{j}, _bx{j}, _by{j}, _bz{j}, _smem{j}, "
                        f"_stream, _argv{j}, 0)")
        checks = [f"    if {arg(name)}:\n        raise ValueError(_refuse[{j}])"
                  for j, name in enumerate((refuse or {}))]
        signature = ", ".join(["_stream", *(f"{a}=0" for a in self.args)])
        self.replay_source = "\n".join([f"def launch_on({signature}):", *checks, "    with _lock:", *body]) + "\n"
        self.launch_on = _replay(self.replay_source, len(slots), len(resolved), len(consts))(
            own.lock, own.words, slots, tuple(resolved), None if scratch is None else scratch.alloc,
            tuple((refuse or {}).values()), tuple(consts))
        self.launch_on.__doc__ = """Write the call's addresses into the struct and launch every step on the raw
        stream handle ``_stream``, on the current device (the one the launch was built for)."""
        # The function holds the struct's and the kernelParams arrays' addresses as integers: it keeps this launch
        # (and so its ParamBuffer) alive, since the call cache keeps only ``bind``'s partial of it.
        self.launch_on.launch = self

    def write_fields(self, values: Mapping[str, int]) -> None:
        """Write 8-byte integer fields of the struct (names as in the NumPy declaration, ``"p.x"`` for nested ones)
        under the launch's lock: a launch retargeted to new sizes (attention/decode_loop.py) keeps its layout, its
        kernels and its replay function."""
        dtype = self.params.dtype
        words = self._own.words
        with self._own.lock:
            for name, value in values.items():
                words[_word_index(dtype, name)] = int(value) & 0xFFFF_FFFF_FFFF_FFFF  # two's complement for < 0

    def struct_bytes(self) -> bytes:
        """The struct as the next replay will send it (before its pointer words are written)."""
        return self._own.bytes.tobytes()

    # A single-kernel launch's shape, as the launchers' tests and explain() read it.
    @property
    def kernel(self):
        return self.steps[0].kernel

    @property
    def grid(self) -> tuple:
        return self.steps[0].grid

    @property
    def block(self) -> tuple:
        return self.steps[0].block

    @property
    def smem(self) -> int:
        return self.steps[0].smem

    def __call__(self, *ptrs: int, stream=None) -> None:
        """Launch on ``stream`` (a CuPy stream; None: CuPy's current stream)."""
        if stream is None:
            import cupy
            stream = cupy.cuda.get_current_stream()
        self.launch_on(stream.ptr, *ptrs)

    def bind(self, stream) -> Callable[..., None]:
        """``run(*addresses)`` launching on ``stream`` (a CuPy stream, or anything with its handle as ``ptr``): what
        the call cache keeps and replays."""
        return functools.partial(self.launch_on, stream.ptr)


@functools.lru_cache(maxsize=256)
def _replay(source: str, n_maps: int, n_steps: int, n_consts: int) -> Callable:
    """A factory of replay functions of this source: ``make(lock, words, map_slots, steps, alloc, refuse, consts)``,
    its objects bound as closure variables (LOAD_DEREF: as fast as a local). The source names struct words by index
    and everything else by variable, so launches of one family share it (a compile costs ~60 µs)."""
    unpack = []
    if n_maps:
        unpack.append(f"    {''.join(f'_maps{j}, ' for j in range(n_maps))}= _map_slots")
    if n_consts:
        unpack.append(f"    {''.join(f'_c{j}, ' for j in range(n_consts))}= _consts")
    for j in range(n_steps):
        unpack.append(f"    _launch{j}, _fn{j}, _gx{j}, _gy{j}, _gz{j}, _bx{j}, _by{j}, _bz{j}, _smem{j}, _argv{j} = "
                      f"_steps[{j}]")
    inner = "\n".join("    " + line for line in source.splitlines())
    factory = "\n".join(["def make(_lock, _words, _map_slots, _steps, _alloc, _refuse, _consts):", *unpack, inner,
                          "    return launch_on"]) + "\n"
    namespace: dict = {}
    exec(compile(factory, "<runtime.launch replay>", "exec"), namespace)
    return namespace["make"]


def launch_struct(kernel, grid: tuple, block: tuple, params: np.ndarray, stream_ptr: int, smem: int = 0) -> None:
    """Launch ``kernel`` once on the struct ``params`` (a 0-d structured array, alive through the call: the driver
    copies it during the call) on the raw stream handle ``stream_ptr``."""
    argv = np.array([params.ctypes.data], dtype=np.uint64)
    if smem and kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    launcher()(int(kernel.kernel.ptr), *_dims(grid, block, smem), stream_ptr, int(argv.ctypes.data), 0)


def _dims(grid: tuple, block: tuple, smem: int) -> tuple:
    """cuLaunchKernel's launch integers: grid x, y, z, block x, y, z (missing axes 1), dynamic shared memory."""
    return (*tuple(grid) + (1,) * (3 - len(grid)), *tuple(block) + (1,) * (3 - len(block)), smem)


# ---------------------------------------------------------------------------------------------------------------------
# The driver entry points: cuLaunchKernel through CuPy, cuLaunchKernelEx through ctypes (programmatic dependent launch).

def launcher(pdl: bool = False):
    """A callable with ``cupy.cuda.driver.launchKernel``'s signature: that function itself, or with ``pdl`` a
    :class:`_PdlLaunch` of its own (a programmatic dependent launch; check :func:`pdl_supported` first)."""
    if pdl:
        return _PdlLaunch()
    from cupy.cuda import driver
    return driver.launchKernel


def pdl_supported(device_id: int) -> bool:
    """Whether launches on this device may use programmatic dependent launch: compute capability 9.0 or newer and a
    driver that exports cuLaunchKernelEx (CUDA 12.0+)."""
    import cupy
    if int(cupy.cuda.Device(device_id).compute_capability) < 90:  # "100" < "90" as strings
        return False
    try:
        return hasattr(_libcuda(), "cuLaunchKernelEx")
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def launch_config_types():
    """ctypes mirrors of cuda.h's CUlaunchAttribute (72 bytes: the id, 4 bytes of padding, a 64-byte value union) and
    CUlaunchConfig (56 bytes), the arguments of cuLaunchKernelEx."""
    import ctypes

    class Value(ctypes.Union):
        _fields_ = [("pad", ctypes.c_char * 64), ("flag", ctypes.c_int)]

    class Attribute(ctypes.Structure):
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", Value)]

    class Config(ctypes.Structure):
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attribute)), ("num_attrs", ctypes.c_uint)]

    return Attribute, Config


class _PdlLaunch:
    """cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (programmatic dependent launch,
    sm_90+), called like ``cupy.cuda.driver.launchKernel``: the kernel may be launched while the previous kernel in
    the stream is still finishing, and must itself wait (``griddepcontrol.wait``) before it reads that kernel's
    output. One CUlaunchConfig (ctypes) per (stream, dimensions), built on first use and never written again, so a
    call is a dictionary look-up and the foreign call (~1.2 µs of host time; writing the config's fields per call
    cost ~4) and threads need no lock."""

    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # cuda.h, CUlaunchAttributeID
    _MAX_CONFIGS = 64  # (stream, dimensions) pairs kept; more (many streams) start the table afresh

    def __init__(self):
        import ctypes
        Attribute, self._Config = launch_config_types()
        self._attr = Attribute()  # shared by every config: read by the driver during each call, never written after
        self._attr.id = self.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value.flag = 1
        self._attr_ptr = ctypes.pointer(self._attr)
        self._configs: dict = {}
        self._fn = _cu_launch_kernel_ex()

    def _config(self, key: tuple):
        import ctypes
        stream_ptr, gx, gy, gz, bx, by, bz, smem = key
        cfg = self._Config()
        cfg.grid[0], cfg.grid[1], cfg.grid[2] = gx, gy, gz
        cfg.block[0], cfg.block[1], cfg.block[2] = bx, by, bz
        cfg.smem, cfg.stream = smem, stream_ptr
        cfg.attrs, cfg.num_attrs = self._attr_ptr, 1
        if len(self._configs) >= self._MAX_CONFIGS:
            self._configs = {}
        ref = self._configs[key] = (cfg, ctypes.addressof(cfg))
        return ref

    def __call__(self, fn_ptr, gx, gy, gz, bx, by, bz, smem, stream_ptr, argv, extra):
        key = (stream_ptr, gx, gy, gz, bx, by, bz, smem)
        ref = self._configs.get(key) or self._config(key)
        err = self._fn(ref[1], fn_ptr, argv, None)
        if err:
            from cupy.cuda import driver
            raise driver.CUDADriverError(err)


@functools.lru_cache(maxsize=None)
def _cu_launch_kernel_ex():
    """libcuda's cuLaunchKernelEx with its signature declared (once: the ctypes function object is shared)."""
    import ctypes
    fn = _libcuda().cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def _libcuda():
    import ctypes
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
