"""The device behind flashsim.gpu: CuPy and the CUDA device, or the CPU emulation
(`emulated`); kernel builds and their caches; launches and I/O counters.

The only module of flashsim that imports CuPy, and only when a function here is called."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from .. import kernels as K
from ..traffic import Traffic

THREADS = K.REF_THREADS
GRID_Y_MAX = 65535

INSTALL_HINT = ('pip install "flashsim[cuda12]" (CUDA 12) or "flashsim[cuda13]" (CUDA 13)')


class GPUUnavailableError(RuntimeError):
    """CuPy is not installed, or no CUDA device is visible."""


class SpillWarning(RuntimeWarning):
    """A kernel as this machine's NVRTC built it keeps data of its threads in local memory
    (a spill or a stack frame). No flashsim kernel does under nvcc (`flashsim kernels
    build` fails on it), so another compiler version made it: the launch gives the same
    results, slower than it should. The test suite makes this warning an error."""


_EMULATED = [os.environ.get("FLASHSIM_EMULATE", "0") not in ("", "0")]
# the compute capability the emulation plays (emulated(compute_capability=...))
EMULATED_CCS = (90, 80)
_EMULATED_CC = [90]


def is_emulated() -> bool:
    """True while flashsim.gpu runs on the CPU emulation (see `emulated`)."""
    return _EMULATED[0]


def emulated_cc() -> int:
    """The compute capability (90 or 80) the CPU emulation plays (see `emulated`)."""
    return _EMULATED_CC[0]


@contextlib.contextmanager
def emulated(enabled: bool = True, *, compute_capability: int = 90):
    """Run flashsim.gpu on the CPU inside this block: the reference rung's CUDA source,
    compiled by the host's C++ compiler, launched with the same grids, arguments and
    shared memory, on NumPy arrays (or PyTorch CPU tensors). Outputs and ``count_io``
    byte counts are the kernels' own, so they can be checked against the simulator with
    no GPU; speed is not a GPU's. ``FLASHSIM_EMULATE=1`` in the environment turns it on
    for the whole process.

        with fs.gpu.emulated():
            out, lse, traffic = fs.gpu.attention(q, k, v, count_io=True)

    ``compute_capability``: 90 (default) plays an H100 (227 KB of shared memory per CTA)
    and builds the mma.sync rung (``kernel="tc"``) in its sm_90 configuration; 80 plays
    an A100 (163 KB) and builds that rung's Ampere tiles, warps and steps, which the
    device tests never run without an Ampere GPU.
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    if compute_capability not in EMULATED_CCS or isinstance(compute_capability, bool):
        raise ValueError(f"the emulation plays compute capability 90 (an H100) or 80 (an "
                         f"A100), got {compute_capability!r}")
    before = _EMULATED[0], _EMULATED_CC[0]
    _EMULATED[0], _EMULATED_CC[0] = bool(enabled), int(compute_capability)
    try:
        yield
    finally:
        _EMULATED[0], _EMULATED_CC[0] = before


def pointer(a) -> int:
    """The address of a device array's first element (CuPy, or NumPy when emulated)."""
    data = a.data
    return data.ptr if hasattr(data, "ptr") else a.ctypes.data


def cupy():
    """CuPy, or the emulation's NumPy stand-in inside `emulated`."""
    if _EMULATED[0]:
        from . import _emulate
        return _emulate.NUMPY_DEVICE
    try:
        import cupy as cp
    except ImportError as e:
        raise GPUUnavailableError(f"flashsim.gpu needs CuPy: {INSTALL_HINT} ({e})") from None
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # the driver or runtime is missing
        raise GPUUnavailableError(f"no CUDA device is visible ({e})") from None
    if n == 0:
        raise GPUUnavailableError("no CUDA device is visible (CUDA_VISIBLE_DEVICES?)")
    return cp


def available() -> bool:
    """True if CuPy imports and a CUDA device is visible (inside `emulated`: if the host
    can build the kernels)."""
    if _EMULATED[0]:
        from . import _emulate
        return _emulate.unavailable_reason() is None
    try:
        cupy()
        return True
    except GPUUnavailableError:
        return False


def compile_options(count_io: bool) -> tuple[str, ...]:
    """NVRTC options (CuPy adds the current device's architecture, -arch=sm_XY)."""
    opts = ("--std=c++17", f"-I{K.kernel_dir()}")
    cp = cupy()
    cuda_path = cp.cuda.get_cuda_path()
    if cuda_path:
        opts += (f"-I{cuda_path}/include",)
    return opts + (("-DFLASHSIM_COUNT_IO",) if count_io else ())


def headers_digest(source: str | None = None) -> str:
    """A digest of the kernels_cu headers that ``source`` includes, directly or through
    another header (kernels.includes), or of every kernels_cu/*.cuh without a source (code
    given as text). CuPy keys its on-disk kernel cache by the source text it is given, not
    by the headers that text includes, so the source carries this: an edit to a header
    rebuilds the sources that include it, and those alone."""
    kdir = K.kernel_dir()
    names = ([n for n in K.includes(source, kdir) if n != source] if source
             else sorted(p.name for p in kdir.glob("*.cuh")))
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0" + (kdir / n).read_bytes() + b"\0")
    return h.hexdigest()[:40]


@functools.lru_cache(maxsize=None)
def module(source: str, count_io: bool, device: int, exprs: tuple | None = None):
    """The kernels of ``source`` built for ``device``: all its instances, or those named
    (``exprs``: NVRTC name expressions). On a GPU every source is built one instance at a
    time, as asked for: each instance takes ptxas seconds (flash2_tc.cu holds over a
    hundred), and a first call should not wait for all of them. The CPU emulation builds
    a source whole."""
    cp = cupy()
    code = (K.kernel_dir() / source).read_text() + f"\n// headers: {headers_digest(source)}\n"
    if source in K.ARCH_SPECIFIC:
        if is_emulated():
            raise GPUUnavailableError(f"{source} ({K.ARCH_SPECIFIC[source]}) is not emulated: "
                                      "the CPU emulation runs the reference rung")
        return ArchModule(source, code, count_io, exprs, K.ARCH_SPECIFIC[source])
    # the instances that run on this device (none needing clusters below 9.0, nor in the
    # CPU emulation)
    target = 0 if is_emulated() else cc(device)
    if exprs is not None and not is_emulated():
        try:
            return ArchModule(source, code, count_io, exprs, f"sm_{target}")
        except UnsupportedArch:
            pass           # a device newer than this NVRTC: CuPy's build (PTX for the driver)
    return cp.RawModule(code=code, options=compile_options(count_io),
                        name_expressions=K.name_expressions(source, target))


class UnsupportedArch(RuntimeError):
    """NVRTC does not know the device's architecture (its only option that can be
    invalid: the rest are fixed)."""


NVRTC_ERROR_INVALID_OPTION = 5


class ArchModule:
    """Instances of a source built by NVRTC into a cubin for ``arch``: the arch-specific
    targets (K.ARCH_SPECIFIC: sm_90a for wgmma), which CuPy's RawModule, naming the plain
    target itself, cannot ask for, and one instance of any source at a time. The cubin and
    the kernels' mangled names are cached on disk beside CuPy's own kernels, keyed by
    everything the build depends on."""

    def __init__(self, source: str, code: str, count_io: bool, exprs, arch: str):
        cp = cupy()
        from cupy_backends.cuda.libs import nvrtc
        exprs = list(exprs or K.name_expressions(source))
        opts = compile_options(count_io) + (f"-arch={arch}",)
        # code ends with the headers' digest (module)
        key = hashlib.sha256("\0".join((code, *opts, *exprs, str(nvrtc.getVersion())))
                             .encode()).hexdigest()[:40]
        cache = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
        path = cache / f"flashsim_{Path(source).stem}_{key}"
        try:
            cubin = path.with_suffix(".cubin").read_bytes()
            names = json.loads(path.with_suffix(".json").read_text())
        except (OSError, ValueError):
            cubin, names = self._compile(nvrtc, source, code, opts, exprs)
            try:   # written whole, then renamed: a concurrent reader sees all or nothing
                cache.mkdir(parents=True, exist_ok=True)
                for suffix, data in ((".cubin", cubin), (".json", json.dumps(names).encode())):
                    fd, tmp = tempfile.mkstemp(dir=cache)
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    os.replace(tmp, path.with_suffix(suffix))
            except OSError:
                pass                                    # no cache: compile again next time
        self.names = names
        self.module = cp.cuda.function.Module()
        self.module.load(cubin)

    @staticmethod
    def _compile(nvrtc, source, code, opts, exprs):
        prog = nvrtc.createProgram(code, source, [], [])
        try:
            for e in exprs:
                nvrtc.addNameExpression(prog, e)
            try:
                nvrtc.compileProgram(prog, list(opts))
            except nvrtc.NVRTCError as e:
                if getattr(e, "status", None) == NVRTC_ERROR_INVALID_OPTION:
                    raise UnsupportedArch(f"NVRTC {nvrtc.getVersion()} rejects {opts[-1]}") from e
                raise RuntimeError(f"NVRTC failed on {source} ({' '.join(opts)}):\n"
                                   f"{nvrtc.getProgramLog(prog)}") from e
            return bytes(nvrtc.getCUBIN(prog)), {e: nvrtc.getLoweredName(prog, e) for e in exprs}
        finally:
            nvrtc.destroyProgram(prog)

    def get_function(self, expr: str) -> "ArchKernel":
        return ArchKernel(self.module.get_function(self.names[expr]))


class ArchKernel:
    """A driver function with what the launchers use of a CuPy RawKernel: ``.kernel``,
    ``shared_size_bytes``, ``max_dynamic_shared_size_bytes`` and a call on the current
    stream."""

    def __init__(self, fn):
        self.kernel = fn

    @property
    def shared_size_bytes(self) -> int:
        """The kernel's static shared memory (launch adds it to the dynamic bytes)."""
        drv = cupy().cuda.driver
        return drv.funcGetAttribute(getattr(drv, "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", 1),
                                    self.kernel.ptr)

    @property
    def local_size_bytes(self) -> int:
        """Local memory per thread (spills, a stack frame): 0 for every flashsim kernel."""
        drv = cupy().cuda.driver
        return drv.funcGetAttribute(getattr(drv, "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES", 3),
                                    self.kernel.ptr)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        drv = cupy().cuda.driver
        return drv.funcGetAttribute(drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    self.kernel.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n: int):
        drv = cupy().cuda.driver
        drv.funcSetAttribute(self.kernel.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                             n)

    def __call__(self, grid, block, args, shared_mem: int = 0):
        pad = lambda t: tuple(t) + (1,) * (3 - len(t))
        self.kernel(pad(grid), pad(block), args, shared_mem=shared_mem,
                    stream=cupy().cuda.get_current_stream())


def kernel(name: str, dtype: str, count_io: bool, D: int | None = None, variant: bool = False,
           varlen: bool = False):
    return kernel_on(name, dtype, count_io, D, cupy().cuda.Device().id, variant, varlen)


@functools.lru_cache(maxsize=None)
def kernel_on(name: str, dtype: str, count_io: bool, D: int | None, device: int,
              variant: bool = False, varlen: bool = False):
    inst = K.instance(name, dtype, D, variant, varlen)
    one = None if is_emulated() else (inst.expr,)
    fn = module(inst.source, count_io, device, one).get_function(inst.expr)
    if not is_emulated():
        check_local_memory(fn, inst.expr, count_io)
    return fn


def check_local_memory(fn, expr: str, count_io: bool = False):
    """A SpillWarning where the built kernel ``fn`` (a CuPy RawKernel or an ArchKernel)
    uses local memory: nvcc's builds of every instance use none (tests/test_kernels.py),
    but the NVRTC that builds them here may be another version, and a spill there is
    seen nowhere else. Checked once per kernel (kernel_on's cache)."""
    n = fn.local_size_bytes
    if n:
        try:
            from cupy_backends.cuda.libs import nvrtc
            version = "NVRTC " + ".".join(map(str, nvrtc.getVersion()))
        except Exception:          # (the message only)
            version = "this NVRTC"
        warnings.warn(f"{expr}{' (instrumented)' if count_io else ''} uses {n} bytes of local "
                      f"memory per thread as {version} built it (spilled registers or a "
                      "stack frame): its results are right, its speed is not what "
                      "kernels_cu/NOTES.md measured", SpillWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def cc(device: int) -> int:
    # CuPy spells the compute capability as a string, "90" for 9.0
    return int(cupy().cuda.Device(device).compute_capability)


@functools.lru_cache(maxsize=None)
def num_sms(device: int) -> int:
    """The device's multiprocessors."""
    return int(cupy().cuda.Device(device).attributes["MultiProcessorCount"])


def cc_major(device: int) -> int:
    return cc(device) // 10



def smem_limit() -> int:
    """Largest dynamic shared memory one CTA may opt in to on the current device."""
    return smem_limit_on(cupy().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def smem_limit_on(device: int) -> int:
    props = cupy().cuda.runtime.getDeviceProperties(device)
    return int(props.get("sharedMemPerBlockOptin", props["sharedMemPerBlock"]))


def check_grid(grid):
    """A ValueError, before any launch, for a grid whose y (or z) axis is past CUDA's
    limit."""
    if grid[1] > GRID_Y_MAX:
        raise ValueError(f"{grid[1]} (batch × heads) problems exceed the grid's y limit "
                         f"{GRID_Y_MAX}; split the batch")
    if len(grid) > 2 and grid[2] > GRID_Y_MAX:
        raise ValueError(f"{grid[2]} (batch × kv_heads) problems exceed the grid's z limit "
                         f"{GRID_Y_MAX}; split the batch")


def launch(cp, kernel, grid, smem: int, args, threads: int = THREADS):
    if 0 in grid:
        return
    check_grid(grid)
    # past 48 KB a CTA's shared memory (dynamic and the kernel's static, such as the
    # varlen instances' few bytes) needs the kernel's opt-in
    if smem + getattr(kernel, "shared_size_bytes", 0) > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = smem
    kernel(grid, (threads,), args, shared_mem=smem)


def counters(cp, count_io: bool):
    """Fresh zeroed counters for an instrumented run; the fast build never touches them,
    so it gets one shared buffer per device instead of an allocation per call."""
    if count_io:
        return cp.zeros(len(K.io_counters()), dtype=cp.uint64)
    return unused_counters(cp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def unused_counters(device: int):
    cp = cupy()
    return cp.zeros(len(K.io_counters()), dtype=cp.uint64)


def scalar(dtype: str, x: float):
    return np.float64(x) if dtype == "float64" else np.float32(x)


def traffic(cp, counters) -> Traffic:
    values = cp.asnumpy(counters).tolist()
    reads, writes = {}, {}
    for (tensor, direction), n in zip(K.io_counters(), values):
        (reads if direction == "read" else writes)[tensor] = int(n)
    return Traffic(reads, writes)
