"""flashsim.gpu on the CPU: the reference rung's CUDA source compiled by the host's C++
compiler against kernels_cu/host_emu.h, and launched through ctypes with the same
arguments, grids and shared memory as on a GPU.

What runs is the kernel source itself (each block's threads as fibers, blocks in
blockIdx order; see host_emu.h), so outputs and the instrumented build's byte counts can
be checked against the simulator on a machine with no GPU. Arrays are NumPy arrays (or
PyTorch CPU tensors). The mma.sync rung runs too, its warp collectives (mma.sync,
ldmatrix, shuffles) emulated lane by lane (kernels_cu/warp.cuh), when asked for with
``kernel="tc"``; ``kernel="auto"`` picks the reference rung, the faster one on a CPU.
The Hopper rung (wgmma, TMA) is not emulated.

Needs a C++20 compiler (``$CXX``, else g++ or clang++) and the CUDA toolkit's headers
for cuda_fp16.h and cuda_bf16.h (``$CUDA_PATH``, ``$CUDA_HOME``, the toolkit of the nvcc
on ``$PATH``, or /usr/local/cuda); no GPU, driver or CuPy.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from .. import kernels as K

DEVICE_ID = -1              # the emulated device's id: caches keyed by device never mix it up
SMEM_BYTES = 227 * 1024     # the host's shared-memory buffer: what an H100's block may opt in to
# per compute capability played (_device.emulated): the device's id (each its own, so that
# caches keyed by device keep the two apart), and the shared memory one CTA may opt in to
DEVICE_IDS = {90: DEVICE_ID, 80: -2}
SMEM_OPTIN = {90: SMEM_BYTES, 80: 163 * 1024}


def played_cc(device=None) -> int:
    """The compute capability of emulated device ``device`` (None: the one in play)."""
    from ._device import emulated_cc
    # an id not the emulation's own (a caller's Device(0)) is the device in play
    return next((cc for cc, i in DEVICE_IDS.items() if i == device), emulated_cc())


_SMEM = re.compile(r"\bextern\s+__shared__\b([^;]*?)(\w+)\s*\[\s*\]\s*;")


def cuda_path() -> str | None:
    """The CUDA toolkit whose include/cuda_fp16.h the host build uses, or None."""
    candidates = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include" / "cuda_fp16.h").is_file():
            return c
    return None


def compiler() -> str | None:
    for c in (os.environ.get("CXX"), "g++", "clang++"):
        if c and shutil.which(c):
            return c
    return None


def unavailable_reason() -> str | None:
    """Why the emulation cannot build kernels here, or None when it can."""
    if compiler() is None:
        return "no C++ compiler (set $CXX, or install g++)"
    if cuda_path() is None:
        return ("the CUDA toolkit's headers (include/cuda_fp16.h) are not found; set "
                "$CUDA_PATH to the toolkit")
    return None


# -- the host build ------------------------------------------------------------------------

def _cache_dir() -> Path:
    root = os.environ.get("FLASHSIM_CACHE_DIR")
    if root:
        return Path(root) / "emulate"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashsim" / "emulate"


_BUILD_LOCK = threading.Lock()
# CUDA code reads memory through other types (a uint4 as eight halves): the host
# compiler must not assume strict aliasing. -O1: a cold tests/test_emulate.py builds in
# 128 s against -O2's 164 s and runs in 98 s against 93 (two cores, g++), and the suite's
# cold run is bound by its builds
_CXXFLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-fPIC", "-shared", "-w",
             "-fvisibility=hidden")


class RawModule:
    """CuPy's RawModule, for the host: ``code`` compiled with ``options`` (its -I and -D
    are kept) into a shared library holding every kernel of ``name_expressions``."""

    def __init__(self, code: str, options=(), name_expressions=()):
        from ._device import GPUUnavailableError
        reason = unavailable_reason()
        if reason is not None:
            raise GPUUnavailableError(f"the CPU emulation cannot build kernels: {reason}")
        flags = [o for o in options if o.startswith(("-I", "-D"))] + ["-DFLASHSIM_HOST"]
        if played_cc() < 90:    # the mma.sync rung's Ampere configuration (flash2_tc.cu)
            flags.append("-DFLASHSIM_TC_AMPERE=1")
        cxx = compiler()
        host_emu = (K.kernel_dir() / "host_emu.h").read_text()
        key = hashlib.sha256("\0".join((code, host_emu, *flags, *_CXXFLAGS, *name_expressions, cxx,
                                        _version(cxx))).encode()).hexdigest()[:40]
        cache = _cache_dir()
        lib = cache / f"flashsim_emu_{key}.so"
        with _BUILD_LOCK:
            if not lib.is_file():
                self._build(code, flags, list(name_expressions), cxx, cache, lib)
        self.lib = ctypes.CDLL(str(lib))
        self.lib.flashsim_emu_launch.restype = ctypes.c_int
        self.names = set(name_expressions)

    @staticmethod
    def _build(code, flags, exprs, cxx, cache, lib):
        names = [m.group(2) for m in _SMEM.finditer(code)]
        body = _SMEM.sub(lambda m: f"extern{m.group(1)}{m.group(2)}[];", code)
        smem = names[0] if names else "flashsim_emu_smem"
        lines = ['#include "host_emu.h"',
                 f"alignas(1024) unsigned char {smem}[{SMEM_BYTES}];"]
        lines += [f"#define {n} {smem}" for n in dict.fromkeys(names[1:]) if n != smem]
        lines += ['#include "kernel.cu"']
        lines += [f'FLASHSIM_EMU_KERNEL("{e}", {e})' for e in exprs]
        lines += [f"FLASHSIM_EMU_DEFINE_LAUNCH({smem}, {SMEM_BYTES})", ""]
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            Path(tmp, "kernel.cu").write_text(body)
            Path(tmp, "shim.cpp").write_text("\n".join(lines))
            out = Path(tmp, "lib.so")
            # hidden symbols and no GNU unique ones: the instrumented and the plain build
            # live in one process, and must not share their registries or kernels
            cmd = [cxx, *_CXXFLAGS,
                   "-fvisibility-inlines-hidden", *_no_gnu_unique(cxx), f"-I{tmp}",
                   f"-I{K.kernel_dir()}", f"-I{cuda_path()}/include", *flags,
                   str(Path(tmp, "shim.cpp")), "-o", str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"the host build of the kernels failed ({' '.join(cmd)}):\n"
                                   f"{r.stderr[-4000:]}")
            os.replace(out, lib)         # whole or not at all, for concurrent readers

    def get_function(self, expr: str) -> "Kernel":
        if expr not in self.names:
            raise KeyError(f"{expr} is not among this module's name expressions")
        return Kernel(self.lib, expr)


@functools.lru_cache(maxsize=None)
def _version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout


def _no_gnu_unique(cxx: str) -> list[str]:
    """GCC marks the statics of inline functions as process-wide (STB_GNU_UNIQUE) even in
    a library loaded RTLD_LOCAL; clang does not, and has no flag for it."""
    return [] if "clang" in _version(cxx) else ["-fno-gnu-unique"]


class Kernel:
    """One kernel of a host build, called as a CuPy RawKernel is: (grid, block, args,
    shared_mem=). Raises RuntimeError with the emulator's message when a launch fails."""

    max_dynamic_shared_size_bytes = SMEM_BYTES

    def __init__(self, lib, expr: str):
        self.lib, self.name = lib, expr.encode()

    def __call__(self, grid, block, args, shared_mem: int = 0):
        pad = lambda t: tuple(int(x) for x in t) + (1,) * (3 - len(t))
        (gx, gy, gz), (bx, by, bz) = pad(grid), pad(block)
        values = [_c_value(a) for a in args]
        ptrs = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        err = ctypes.create_string_buffer(1024)
        rc = self.lib.flashsim_emu_launch(self.name, gx, gy, gz, bx, by, bz,
                                          ctypes.c_ulonglong(shared_mem), ptrs, err,
                                          ctypes.c_ulong(len(err)))
        if rc:
            raise RuntimeError(f"{self.name.decode()}: {err.value.decode()}")


_C_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
              np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
              np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def _c_value(a):
    """A kernel argument as the C value whose address goes into kernelParams."""
    if isinstance(a, np.ndarray):
        return ctypes.c_void_p(a.ctypes.data)
    if a is None:
        return ctypes.c_void_p(0)
    if isinstance(a, np.generic) and a.dtype in _C_SCALARS:
        return _C_SCALARS[a.dtype](a.item())
    raise TypeError(f"kernel arguments are NumPy arrays or NumPy scalars of a fixed width "
                    f"(np.int32(n), np.float32(x)), as CuPy takes them; got {a!r}")


# -- NumPy as the device's array module ----------------------------------------------------

class _Device:
    """cupy.cuda.Device for the emulated device."""
    # the host build of the mma.sync rung is its sm_90 configuration (no __CUDA_ARCH__), or
    # its Ampere one when the emulation plays 8.0 (FLASHSIM_TC_AMPERE defined by RawModule);
    # "auto" still picks the reference rung here (flashsim.gpu.flash2._choose)

    def __init__(self, device=None):
        self.id = DEVICE_IDS[played_cc()] if device is None else device

    @property
    def compute_capability(self) -> str:
        return str(played_cc(self.id))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        pass


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDeviceProperties(device):
        return {"name": b"flashsim CPU emulation",
                "sharedMemPerBlockOptin": SMEM_OPTIN[played_cc(device)],
                "sharedMemPerBlock": 48 * 1024, "multiProcessorCount": 1}


class _Cuda:
    Device = _Device
    runtime = _Runtime

    @staticmethod
    def get_current_stream():
        return None

    @staticmethod
    def get_cuda_path():
        return cuda_path()


class NumpyDevice:
    """The subset of CuPy's module that flashsim.gpu uses, on NumPy arrays."""
    cuda = _Cuda
    RawModule = RawModule

    @staticmethod
    def asnumpy(a):
        return np.array(a)

    def __getattr__(self, name):
        return getattr(np, name)


NUMPY_DEVICE = NumpyDevice()
