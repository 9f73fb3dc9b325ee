"""A thin layer over the CUDA driver API (``cuda.bindings.driver``): context and stream, device
memory, modules and kernel launches, graph capture, events.

Memory comes from plain ``cuMemAlloc`` (never managed memory). Activations come from a caching
:class:`Pool`: a block returns to its pool when the last array viewing it is garbage collected,
so steady-state steps allocate nothing from the driver and never synchronize.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import struct
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from leat.errors import LeatError

_local = threading.local()
# Graphs being captured now, in any thread. A driver free or destroy meanwhile (cuMemFree and cuMemFreeHost
# synchronize the device; so does a cuBLAS handle's destroy, which frees its workspace; graphs' and events' destroys
# too, at times) would invalidate the capture, and Python may drop an object at any point of one (its garbage
# collector runs when objects are created, and frees what cycles held: another backend's handle, say): such releases
# wait here until the last capture ends.
_captures = 0
_capture_lock = threading.RLock()  # reentrant: a collection inside a locked section may free more
_deferred: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []


def release(function: Callable[..., Any], *args: Any) -> None:
    """``function(*args)`` (a free or destroy) now, or once no graph is being captured; its errors are ignored (at
    interpreter exit the bindings may be gone)."""
    with _capture_lock:
        if _captures:
            _deferred.append((function, args))
            return
    with contextlib.suppress(Exception):
        function(*args)


def _free(function: str, ptr: int) -> None:
    """``cuMemFree`` or ``cuMemFreeHost`` of ``ptr`` now, or once no graph is being captured."""
    with contextlib.suppress(Exception):  # at interpreter exit the bindings may be gone
        release(getattr(_cu(), function), ptr)


@contextlib.contextmanager
def _capture_scope():
    """While a graph is captured: driver frees wait (see ``_captures``), made when the last capture ends."""
    global _captures
    with _capture_lock:
        _captures += 1
    try:
        yield
    finally:
        with _capture_lock:
            _captures -= 1
            due = _deferred[:] if not _captures else []
            if due:
                _deferred.clear()
        for function, args in due:
            with contextlib.suppress(Exception):
                function(*args)


class CudaError(LeatError):
    """A CUDA driver call failed."""


_driver: Any = None


def _cu():
    global _driver
    if _driver is None:  # imported once: a launch asks for it each time
        from cuda.bindings import driver

        _driver = driver
    return _driver


def check(result: Any, what: str = "CUDA call") -> Any:
    """The values of a driver call's result tuple, raising :class:`CudaError` on an error code."""
    cu = _cu()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)
        text = name[1].decode() if isinstance(name, tuple) and name[0] == cu.CUresult.CUDA_SUCCESS else str(err)
        raise CudaError(f"{what} failed: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def probe() -> str | None:
    """None when a CUDA device this backend can use is present, else why not."""
    try:
        cu = _cu()
    except ImportError as e:
        return f"cuda-python is not installed ({e})"
    try:
        (err,) = cu.cuInit(0)
    except Exception as e:  # noqa: BLE001 - cuda-pathfinder raises its own error when libcuda.so is missing
        return f"no NVIDIA driver ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'libcuda not found'})"
    if err == cu.CUresult.CUDA_ERROR_NO_DEVICE:
        return "no CUDA device"
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuInit failed ({err.name})"
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count == 0:
        return "no CUDA device"
    major = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0))
    minor = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0))
    if major < 8:
        return f"compute capability {major}.{minor}: leat's CUDA kernels need 8.0 or newer"
    try:
        from leat_backend_cuda.compiler import nvrtc_version

        nvrtc_version()
    except Exception as e:  # noqa: BLE001 - any failure to load NVRTC means the same to the user
        return f"NVRTC is not usable ({e}); install nvidia-cuda-nvrtc"
    return None


class Device:
    """The primary context of one GPU, and one non-blocking stream that every op runs on."""

    def __init__(self, ordinal: int = 0):
        cu = _cu()
        check(cu.cuInit(0), "cuInit")
        self.ordinal = ordinal
        self.handle = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        self.activate()
        attr = cu.CUdevice_attribute
        get = lambda a: check(cu.cuDeviceGetAttribute(a, self.handle))
        self.capability = (
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        )
        self.sm_count = get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.smem_optin = get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.name = check(cu.cuDeviceGetName(256, self.handle)).split(b"\0")[0].decode()
        self.driver_version = check(cu.cuDriverGetVersion())
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def activate(self) -> None:
        """Make this context current on the calling thread (the engine runs steps on its own thread)."""
        if getattr(_local, "context", None) is not self.context:
            check(_cu().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
            _local.context = self.context

    def synchronize(self) -> None:
        check(_cu().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def free_memory(self) -> tuple[int, int]:
        self.activate()
        return check(_cu().cuMemGetInfo())

    # -- copies --------------------------------------------------------------------------------------
    def upload(self, dst: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        check(_cu().cuMemcpyHtoDAsync(dst, host.ctypes.data, host.nbytes, self.stream), "cuMemcpyHtoDAsync")

    def download(self, host: np.ndarray, src: int) -> None:
        check(_cu().cuMemcpyDtoHAsync(host.ctypes.data, src, host.nbytes, self.stream), "cuMemcpyDtoHAsync")
        self.synchronize()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        check(_cu().cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def fill(self, dst: int, byte: int, nbytes: int) -> None:
        check(_cu().cuMemsetD8Async(dst, byte, nbytes, self.stream), "cuMemsetD8Async")


class Memory:
    """One driver allocation, freed when the object is collected."""

    __slots__ = ("__weakref__", "nbytes", "ptr")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(_cu().cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc({nbytes} bytes)"))

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter exit the bindings may be gone
            _free("cuMemFree", self.ptr)


def size_class(nbytes: int) -> int:
    """Rounded-up allocation size: multiples of 256 bytes up to 4 KiB, then four classes per octave."""
    if nbytes <= 4096:
        return max(256, -(-nbytes // 256) * 256)
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


class Block:
    """A pooled piece of device memory; back to its pool when collected."""

    __slots__ = ("__weakref__", "pool", "ptr", "size")

    def __init__(self, ptr: int, size: int, pool: Pool):
        self.ptr, self.size, self.pool = ptr, size, pool

    def __del__(self):
        try:  # (not contextlib.suppress: this runs for every activation a step frees)
            self.pool.free[self.size].append(self.ptr)
        except Exception:  # noqa: BLE001, S110 - at interpreter exit the pool may be gone
            pass


class Pool:
    """Caching allocator for activations and scratch.

    A CUDA graph gets a private pool: the blocks its capture used stay reserved for its replays.
    ``on_grow`` is told the bytes each new driver allocation adds.
    """

    def __init__(self, device: Device, on_grow: Callable[[int], None], poison: bool = False):
        self.device = device
        self.on_grow = on_grow
        self.poison = poison
        self.free: dict[int, list[int]] = defaultdict(list)
        self.memory: list[Memory] = []
        self.reserved = 0

    def take(self, nbytes: int) -> Block:
        size = size_class(nbytes)
        free = self.free[size]
        if free:
            ptr = free.pop()
        else:
            mem = Memory(size)
            self.memory.append(mem)
            self.reserved += size
            self.on_grow(size)
            ptr = mem.ptr
        if self.poison:  # NaN in every float32 and f16 element until a kernel writes it
            self.device.fill(ptr, 0xFF, size)
        return Block(ptr, size, self)

    def release_all(self) -> int:
        """Return every driver allocation (only when no array from this pool is alive)."""
        freed = self.reserved
        self.free.clear()
        self.memory.clear()
        self.reserved = 0
        return freed


class DeviceArray:
    """A contiguous device array: pointer, shape, numpy dtype, and the block that owns the memory."""

    __slots__ = ("dtype", "owner", "ptr", "shape")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype, owner: Any):
        self.ptr, self.shape, self.owner = ptr, tuple(map(int, shape)), owner
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def view(self, shape: Sequence[int], offset_items: int = 0) -> DeviceArray:
        return DeviceArray(self.ptr + offset_items * self.dtype.itemsize, tuple(shape), self.dtype, self.owner)

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype.name})"


_POINTERS = (DeviceArray, Memory, Block)  # the arguments passed as their device pointer
_FLOAT = struct.Struct("<f")
_UINT = struct.Struct("<I")


def _slot(value: Any) -> Any:
    """An argument that is not a Python int or float, as :class:`Kernel`'s packing takes it."""
    if value is None:
        return 0
    if isinstance(value, int | np.integer):  # numpy's, and int's subclasses (bool, enums)
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value)
    return value.ptr  # DeviceArray, Memory, Block


def _param(value: Any) -> int:
    """An argument as its 8-byte slot's bits, one at a time (the packing's fallback): a float as float32."""
    slot = _slot(value)
    if isinstance(slot, float):
        return _UINT.unpack(_FLOAT.pack(slot))[0]
    return slot & 0xFFFFFFFFFFFFFFFF


_PLAIN = (int, float)
_SUCCESS = 0  # CUresult.CUDA_SUCCESS (an int enum)


class Kernel:
    """One compiled kernel. Arguments travel in 8-byte slots: device arrays as pointers, Python ints
    as 64-bit integers (an ``int`` parameter reads the low half), floats as float32 bits.

    A launch packs its arguments with one ``struct`` call (a float32 slot for each ``.f32`` parameter, a 64-bit
    integer for every other), not an argument at a time: an eagerly run step's host time is largely its launches
    (a 512-token prefill of the 8B bench file on the H200's host, ``scripts/prefill_host.py``: 323 launches at ~20
    us each, 7 of them inside cuLaunchKernel, when each argument went through ``_param``)."""

    __slots__ = ("_address", "_occupancy", "_pack", "_pointers", "_values", "device", "function", "name", "params")

    def __init__(self, function: Any, name: str, device: Device, params: list[str]):
        self.function, self.name, self.device, self.params = function, name, device, params
        self._values = np.zeros(max(len(params), 1), np.uint64)
        self._pointers = self._values.ctypes.data + 8 * np.arange(len(self._values), dtype=np.uint64)
        self._address = self._pointers.ctypes.data  # an int: numpy's .ctypes costs microseconds per launch
        self._pack = struct.Struct("<" + "".join("f4x" if p == ".f32" else "q" for p in params)).pack_into
        self._occupancy: dict[tuple[int, int], int] = {}

    def occupancy(self, block: int, smem: int = 0) -> int:
        """Blocks of this size that fit on one multiprocessor at once."""
        key = (block, smem)
        if key not in self._occupancy:
            blocks = check(_cu().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, block, smem), "occupancy")
            self._occupancy[key] = max(1, int(blocks))
        return self._occupancy[key]

    def __call__(self, grid: Sequence[int], block: int, *args: Any, smem: int = 0) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, not {len(args)}")
        try:
            self._pack(
                self._values,
                0,
                *[a if type(a) in _PLAIN else a.ptr if type(a) in _POINTERS else _slot(a) for a in args],
            )
        except struct.error:  # an int over 63 bits, a float for an integer parameter: each as 8 bytes, as _param
            self._values[: len(args)] = [_param(a) for a in args]
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        err = _cu().cuLaunchKernel(self.function, gx, gy, gz, block, 1, 1, smem, self.device.stream, self._address, 0)
        if err[0] != _SUCCESS:
            check(err, f"launch of {self.name}")


class Module:
    """A loaded cubin and its kernels by name expression."""

    def __init__(
        self,
        device: Device,
        cubin: bytes,
        names: dict[str, str],
        params: dict[str, list[str]],
        smem: dict[str, int] | None = None,
    ):
        cu = _cu()
        device.activate()
        self.handle = check(cu.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.kernels: dict[str, Kernel] = {}
        for expr, mangled in names.items():
            function = check(cu.cuModuleGetFunction(self.handle, mangled.encode()), f"cuModuleGetFunction({expr})")
            need = (smem or {}).get(expr, 0)
            if need > 48 * 1024:
                attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                check(cu.cuFuncSetAttribute(function, attr, need), f"shared memory for {expr}")
            self.kernels[expr] = Kernel(function, expr, device, params[expr])

    def __getitem__(self, name: str) -> Kernel:
        return self.kernels[name]


class Graph:
    """A captured sequence of launches on the device's stream, replayed with one call."""

    def __init__(self, device: Device, capture: Callable[[], Any]):
        cu = _cu()
        self.device = device
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        with _capture_scope():
            check(cu.cuStreamBeginCapture(device.stream, mode), "cuStreamBeginCapture")
            try:
                self.result = capture()
            except BaseException:
                graph = cu.cuStreamEndCapture(device.stream)
                if isinstance(graph, tuple) and len(graph) > 1 and graph[1] is not None:
                    cu.cuGraphDestroy(graph[1])
                raise
            self.graph = check(cu.cuStreamEndCapture(device.stream), "cuStreamEndCapture")
        self.exec = check(cu.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")

    def replay(self) -> None:
        check(_cu().cuGraphLaunch(self.exec, self.device.stream), "cuGraphLaunch")

    def __del__(self):
        with contextlib.suppress(Exception):
            cu = _cu()
            release(cu.cuGraphExecDestroy, self.exec)
            release(cu.cuGraphDestroy, self.graph)


class Pinned:
    """Page-locked host memory: a device-to-host copy into it returns at once (into pageable memory it waits)."""

    __slots__ = ("array", "nbytes", "ptr")

    def __init__(self, nbytes: int):
        self.nbytes = max(nbytes, 1)
        self.ptr = int(check(_cu().cuMemHostAlloc(self.nbytes, 0), f"cuMemHostAlloc({nbytes} bytes)"))
        self.array = np.ctypeslib.as_array((ctypes.c_ubyte * self.nbytes).from_address(self.ptr))

    def __del__(self):
        with contextlib.suppress(Exception):
            _free("cuMemFreeHost", self.ptr)


class Event:
    """A point on the device's stream the host can wait for."""

    def __init__(self, device: Device):
        cu = _cu()
        self.device = device
        self.handle = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")

    def record(self) -> None:
        check(_cu().cuEventRecord(self.handle, self.device.stream), "cuEventRecord")

    def wait(self) -> None:
        check(_cu().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def __del__(self):
        with contextlib.suppress(Exception):
            release(_cu().cuEventDestroy, self.handle)


class Timer:
    """Device time between two points on the stream, in seconds."""

    def __init__(self, device: Device):
        cu = _cu()
        self.device = device
        self.start = check(cu.cuEventCreate(0))
        self.end = check(cu.cuEventCreate(0))

    def __enter__(self) -> Timer:  # noqa: PYI034
        check(_cu().cuEventRecord(self.start, self.device.stream))
        return self

    def __exit__(self, *exc: object) -> None:
        check(_cu().cuEventRecord(self.end, self.device.stream))

    @property
    def seconds(self) -> float:
        check(_cu().cuEventSynchronize(self.end))
        return check(_cu().cuEventElapsedTime(self.start, self.end)) / 1e3

    def __del__(self):  # an engine that profiles (`leat serve --step-log`) makes one per step
        with contextlib.suppress(Exception):
            release(_cu().cuEventDestroy, self.start)
            release(_cu().cuEventDestroy, self.end)
