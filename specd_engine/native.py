"""specd's own CPU kernels (native/*.c), compiled once a machine into one shared library and loaded with ctypes.

Why: a few of a CPU pass's steps have no PyTorch kernel that keeps a row's bits its own while serving
many rows at once: the int4 products (int4_tiles.py) and attention over a KV store in place
(store_attention.py); and where framework operators between products cost more than the products,
whole steps run in one call: a pass's decoder layers (native_decoder.py) and the Medusa heads'
proposals (verify_service/native_heads.py). The C files are compiled with the system's C compiler into specd's cache folder
(runtime_cache.cache_root(), ~1 s), or beside their sources when an image is built (`python -m
specd_engine.native`), and the library's name is a digest of the sources and flags, so an edit never
loads a stale build. OpenMP binds to the runtime torch already loaded (libgomp.so.1 by soname), so the
kernels' threads are torch's: import torch first. Each user checks the CPU flags its code executes
(missing_cpu_flags) before calling into it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Optional

import torch  # noqa: F401: loaded first, so the library's OpenMP is torch's

log = logging.getLogger(__name__)

FOLDER = Path(__file__).parent / "native"
SOURCES = sorted(FOLDER.glob("*.c"))
HEADERS = sorted(FOLDER.glob("*.h"))
TILE_FLAGS = ("amx_tile", "amx_bf16", "avx512bw", "avx512_bf16")  # what the tile-unit code executes (/proc/cpuinfo)
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_loaded: Optional[tuple[Optional[ctypes.CDLL], str]] = None  # (library, why not): decided once a process
_tiles: Optional[bool] = None  # whether this process may use Intel AMX's tile unit: decided once


def load() -> tuple[Optional[ctypes.CDLL], str]:
    """(the library, ""), or (None, why it cannot load: no compiler, a failed build); decided once."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                path = _built_library()
                _loaded = (ctypes.CDLL(str(path)), "") if path else \
                    (None, "no C compiler to build specd's native kernels, and no build of them beside their sources")
            except (OSError, subprocess.SubprocessError) as error:
                _loaded = None, f"specd's native kernels did not build or load: {error}"
            if _loaded[1]:
                log.info("native kernels: %s", _loaded[1])
        return _loaded


class Int4Weight(ctypes.Structure):
    """A tile-packed int4 product's weight as the C code reads it (tiles.h's specd_int4)."""

    _fields_ = [("nibbles", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p)]

    @classmethod
    def of(cls, product) -> "Int4Weight":
        """The addresses of a quantized.Int4Linear's packed buffers (tiles=True)."""
        return cls(product.nibbles.data_ptr(), product.tile_scale.data_ptr(), product.tile_zero.data_ptr())


_entries: dict[str, ctypes._CFuncPtr] = {}
_entries_lock = threading.Lock()  # not _lock: load() takes that one


def entry(name: str, argtypes: list) -> ctypes._CFuncPtr:
    """The library's function `name` (returning int), its argument types set once; the library must load."""
    with _entries_lock:
        if name not in _entries:
            library, why = load()
            if library is None:
                raise OSError(why)
            function = getattr(library, name)
            function.restype, function.argtypes = ctypes.c_int, argtypes
            _entries[name] = function
        return _entries[name]


def tile_unit() -> bool:
    """Whether the kernels may use Intel AMX's tile unit here: the CPU has it (TILE_FLAGS), the library
    loads and the OS grants this process the tile state (decided once)."""
    global _tiles
    library = load()[0]
    with _lock:
        if _tiles is None:
            _tiles = library is not None and not missing_cpu_flags(TILE_FLAGS) and bool(library.specd_amx_init())
        return _tiles


def identity() -> str:
    """The build's name without its suffix, for keys of cached timings."""
    return library_name().removesuffix(".so")


def library_name() -> str:
    """A digest of the sources and the flags: an edit of either names a new file."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS) + " ".join(FLAGS).encode())
    return f"specd_native-{digest.hexdigest()[:16]}.so"


def missing_cpu_flags(wanted: tuple[str, ...]) -> list[str]:
    """Which of `wanted` (as /proc/cpuinfo names them) this CPU lacks (all of them where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(wanted)
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return [flag for flag in wanted if flag not in flags]


def _built_library() -> Optional[Path]:
    """Beside the sources where an image built it, else in specd's cache, compiled on first use."""
    beside = FOLDER / library_name()
    if beside.exists():
        return beside
    from specd_engine.runtime_cache import cache_root

    cached = cache_root() / "native" / library_name()
    return cached if cached.exists() else build(cached.parent)


def build(folder: Path) -> Optional[Path]:
    """Compile every source into `folder` (None without a C compiler). Needs none of the instruction sets it
    compiles for: an image builds it anywhere."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    target = folder / library_name()
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{target.name}.{os.getpid()}"
    subprocess.run([compiler, *FLAGS, "-o", str(partial), *map(str, SOURCES)], check=True, capture_output=True, timeout=180)
    partial.replace(target)  # atomic: a concurrent start sees the whole file or none
    return target


if __name__ == "__main__":  # an image's build step: the kernels compiled beside their sources, for a runtime without a compiler
    built = build(FOLDER)
    if built is None:
        raise SystemExit("no C compiler (cc): specd's native kernels were not built")
    print(built)
