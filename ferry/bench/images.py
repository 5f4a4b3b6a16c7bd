"""Images for benchmark workloads: deterministic pictures of each request's sizes, placed in front
of its prompt tokens through the model's own image prompt rules."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ferry.bench.workload import WorkloadRequest, parse_image_size


def bench_image(width: int, height: int, k: int) -> Any:
    """A deterministic RGB image of width x height pixels (pattern ``k``)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(k).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def with_images(reqs: list[WorkloadRequest], prompter: Any, size: str | None = None) -> list[WorkloadRequest]:
    """Each request's prompt with its images (``image_sizes``; ``size`` "WxH" for those that name
    none) in front of its tokens. Every image has its own pattern: no two share an encoder output."""
    default = (parse_image_size(size, "--image-size"),) if size else ()
    if not default and not any(r.image_sizes for r in reqs):
        return list(reqs)
    if prompter is None:
        raise ValueError("the workload has images, but the model takes none")
    out, k = [], 0
    for r in reqs:
        sizes = r.image_sizes or default
        if not sizes:
            out.append(r)
            continue
        pictures = [bench_image(w, h, k + j) for j, (w, h) in enumerate(sizes)]
        k += len(sizes)
        ids, features = prompter.encode(prompter.placeholder * len(sizes), pictures)
        out.append(replace(r, prompt_token_ids=ids + list(r.prompt_token_ids), image_sizes=sizes, images=features))
    return out
