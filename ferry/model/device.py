"""Where the model runs: the device, its default dtype, and a KV cache sized from its memory."""
from __future__ import annotations

import math
import mmap
import os

import numpy as np
import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """``auto``: the FERRY_DEVICE environment variable if set, else CUDA when torch sees a GPU,
    else the CPU. ``cuda`` without one is an error."""
    if name == "auto":
        if os.environ.get("FERRY_DEVICE"):
            return resolve_device(os.environ["FERRY_DEVICE"])
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU here "
                         f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use device 'cpu' or 'auto'")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    return torch.device(name)


def default_dtype(device: torch.device) -> str:
    """float32 on the CPU (the C kernels and quantized weights compute in float32); bfloat16 on
    a GPU that supports it, else float16."""
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def kv_blocks_for_memory(total: int, free: int, utilization: float, bytes_per_block: int,
                         activation_bytes: int) -> int:
    """KV blocks a GPU engine gets, as vLLM sizes them: the engine may use ``utilization`` of the
    device's ``total`` memory; what is already in use (``total - free``: weights, other
    processes) and the activations of the largest step come off that, the rest is KV cache."""
    budget = total * utilization - (total - free) - activation_bytes
    if budget < bytes_per_block:
        raise ValueError(
            f"no room for a KV cache: {utilization:.0%} of {total / 2**30:.1f} GiB, less {(total - free) / 2**30:.1f} GiB "
            f"in use and {activation_bytes / 2**30:.1f} GiB for activations, leaves {max(budget, 0) / 2**30:.2f} GiB; "
            f"raise gpu_memory_utilization or lower max_num_batched_tokens")
    return int(budget // bytes_per_block)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the OS maps and zeroes on first touch: only what is used
    takes memory, and nothing is written at start-up.

    Plain anonymous pages, not numpy's zeros: numpy advises huge pages for large arrays, and where
    the kernel compacts memory for advised regions on a fault (defrag ``madvise``, the default) each
    first touch stalls; measured on a 2-core VM, a 512-token prefill step's K/V writes took 96 ms
    into numpy's zeros and 7 ms into these."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(pages, dtype=np.uint8, count=nbytes)  # keeps the mapping alive
    return torch.from_numpy(raw).view(dtype).view(shape)


def release_freed_memory() -> None:
    """Give the heap's freed pages back to the system (glibc's malloc_trim; nothing elsewhere).

    Loading leaves holes: q8 mode packs every weight into a new buffer and frees the file's copy,
    and glibc keeps freed mid-sized blocks, so a process held ~80 MB more than its weights (the
    embedded model, measured) until trimmed.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)
