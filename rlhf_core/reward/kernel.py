"""The text components' fused CPU kernel: `text_kernel.c`, compiled once per machine with the system C compiler
and called through ctypes on the tensors' memory.

On CPU a text component is a few hundred small tensor ops, and their dispatch (~5 µs each) costs more than the
work: `answer_after_marker` at B=256, L=1024 spent ~3.7 ms, ~2.4 ms of it fixed. The kernel does the same
computation (the same windows, limits and byte classes as the tensor code in `text.py`, held equal by
tests/test_reward_kernel.py) in one loop per row, on the tensors in place: no copy, no decode, no Python per
row. The tensor code stays the reference and the path on every other device (on an accelerator its ops are
kernels already), and the path on CPU when the kernel is unavailable.

Built on first use into `$ATRLHF_KERNEL_CACHE` (default `~/.cache/atrlhf/kernels`, else a temporary directory),
named by the hash of the source and the compiler, so a changed source is rebuilt and concurrent processes
(Ray workers) share one build (written to a temporary name, then renamed). The compiler is `$CC`, else `cc`,
`gcc` or `clang`; without one (or if the build fails) a warning is logged once and the tensor code is used.
`ATRLHF_TEXT_KERNEL=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("text_kernel.c")
MAX_WIDTH = 4096
"""Widest byte window the kernel reads (MAX_W in the source); wider windows use the tensor code."""

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict = {}

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "atr_init": [_P],
    "atr_scan": [_P, ctypes.c_int, _I, _I, _I, _P, _I, _P, _P, _P],
    "atr_answer_after_marker": [_P, _P, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I]
    + [_I, _I, _I, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int, _P],
    "atr_exact_match": [_P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int, _P],
    "atr_contains": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P],
    "atr_format_window": [_P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, ctypes.c_int, _I, _I, _I, _I, _P, _P],
    "atr_format_tokens": [_P, _I, _I, _P, _P, _P, _P, _P, _I, _I, _P],
}


def enabled() -> bool:
    """Whether the kernel may be used (ATRLHF_TEXT_KERNEL is not 0 / false / off)."""
    return os.environ.get("ATRLHF_TEXT_KERNEL", "1").strip().lower() not in ("0", "false", "off", "no")


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0]) and cc
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _cache_dir() -> Path:
    configured = os.environ.get("ATRLHF_KERNEL_CACHE")
    candidates = [Path(configured)] if configured else []
    candidates += [Path.home() / ".cache" / "atrlhf" / "kernels", Path(tempfile.gettempdir()) / "atrlhf-kernels"]
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise OSError(f"no writable directory for the kernel build among {', '.join(map(str, candidates))}")


def build(cc: str | None = None) -> Path:
    """Compile the kernel (if this source and compiler have no build yet) and return the shared library's path.
    Raises RuntimeError with the compiler's output when the build fails."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + cc.encode()).hexdigest()[:16]
    out = _cache_dir() / f"text_kernel-{digest}.so"
    if out.exists():
        return out
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.{threading.get_ident()}.tmp.so")
    cmd = [*cc.split(), "-O2", "-std=c99", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.strip()}")
    os.replace(tmp, out)
    return out


def load():
    """The loaded kernel (ctypes.CDLL, argument types set, byte classes passed), or None: disabled, no compiler,
    or the build failed (logged once, with the reason). Built and loaded once per process."""
    if not enabled():
        return None
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _load()
    return _state["lib"]


def _load():
    import torch

    from rlhf_core.reward.text import _CLASSES

    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("text reward: the CPU kernel is unavailable, using the tensor code (slower on CPU): %s", e)
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    classes = _CLASSES.to(torch.int64).contiguous()
    lib.atr_init(classes.data_ptr())
    return lib


def ptr(t) -> int:
    """The data pointer of a contiguous tensor (the kernel reads it in place)."""
    assert t.is_contiguous(), "the text kernel reads contiguous tensors only"
    return t.data_ptr()
