"""A Hugging Face model name -> a local directory or GGUF file, as llama.cpp's ``-hf``, Ollama's
``pull`` and vLLM read one.

``ORG/NAME`` is a repository of a config.json and safetensors weights (its snapshot directory);
``ORG/NAME:QUANT`` is the GGUF file of that repository whose name carries the quant tag
(case-insensitive). A GGUF repository named without a tag gives llama.cpp's default: Q4_K_M,
else Q8_0, else the first GGUF file. The local Hugging Face cache (HF_HOME, HF_HUB_CACHE) is
read first, with no network; a model not there is downloaded through ``huggingface_hub``
(its progress bar) unless HF_HUB_OFFLINE is set. A local path of the same spelling always wins.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

# A repository id (huggingface_hub's rule: word characters, '.', '-') and an optional quant tag.
_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[A-Za-z0-9][\w.-]*))?")
# llama.cpp's split GGUFs: NAME-00001-of-00003.gguf.
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
# GGUF files beside a model that are not one (llama.cpp's list): projectors, importance matrices, drafts.
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
# llama.cpp's preference for a GGUF repository named without a tag.
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
# What ferry reads of a safetensors repository: the rest (.bin, .pth, .onnx, GGUFs) can be gigabytes.
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def parse_name(model: str) -> tuple[str, str | None] | None:
    """``(repo_id, tag)`` of ``ORG/NAME[:QUANT]``, or None when ``model`` is not spelled as a name."""
    m = _NAME.fullmatch(model)
    if m is None or ".." in m["repo"] or "--" in m["repo"]:
        return None
    return m["repo"], m["tag"]


def is_hub_name(model: str) -> bool:
    """Whether ``model`` stands for a Hugging Face name: spelled as one, and no local path (which wins)."""
    return not Path(model).expanduser().exists() and parse_name(model) is not None


def local_model(model: str) -> Path:
    """The local path ``model`` stands for: itself where it exists (or is no name), else the
    directory or GGUF file its Hugging Face name resolves to (a FileNotFoundError if none)."""
    path = Path(model).expanduser()
    if not is_hub_name(model):
        return path
    from huggingface_hub import constants

    return _resolve(model, str(constants.HF_HUB_CACHE), bool(constants.HF_HUB_OFFLINE))


@functools.lru_cache(maxsize=32)
def _resolve(model: str, cache_dir: str, offline: bool) -> Path:
    # Kept per process: the engine, its loader and the tokenizer each ask, the network once.
    repo_id, tag = parse_name(model)  # type: ignore[misc]
    found = from_cache(repo_id, tag, cache_dir)
    if found is not None:
        return found
    if offline:
        raise FileNotFoundError(f"model {model!r} is not a local path and not in the Hugging Face cache "
                                f"{cache_dir}{_what_is_cached(repo_id, tag, cache_dir)}; HF_HUB_OFFLINE is set, "
                                f"so it was not downloaded")
    return download(model, repo_id, tag, cache_dir)


def from_cache(repo_id: str, tag: str | None, cache_dir: str) -> Path | None:
    """The cached directory or GGUF file of a repository, with no network; None if it is not there."""
    from huggingface_hub import snapshot_download, try_to_load_from_cache

    commit, files = cached_files(repo_id, cache_dir)
    if not files:
        return None
    if tag is not None or not has_weights(files):
        name = pick_gguf(files, tag, repo_id, missing_ok=True)
        path = try_to_load_from_cache(repo_id, name, cache_dir=cache_dir, revision=commit) if name else None
        return Path(path) if isinstance(path, str) else None
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=cache_dir, revision=commit, local_files_only=True,
                                          allow_patterns=WEIGHT_PATTERNS))
    except OSError:  # huggingface_hub's LocalEntryNotFoundError: an incomplete snapshot, a download completes it
        return None
    return snapshot if complete(snapshot) else None


def cached_files(repo_id: str, cache_dir: str) -> tuple[str | None, list[str]]:
    """The commit of a repository's cached main revision (its newest one if main is not cached)
    and that revision's files as ``scan_cache_dir`` sees them: paths inside the repository, sorted."""
    from huggingface_hub import scan_cache_dir

    if not Path(cache_dir).is_dir():
        return None, []
    for repo in scan_cache_dir(cache_dir).repos:
        if repo.repo_id != repo_id or repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        return rev.commit_hash, sorted(f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files)
    return None, []


def has_weights(files: list[str]) -> bool:
    """A repository ferry loads as a directory: a config.json and safetensors weights."""
    return "config.json" in files and any(f.endswith(".safetensors") for f in files)


def complete(snapshot: Path) -> bool:
    """A cached snapshot holds config.json and every weight file its index names."""
    import json

    if not (snapshot / "config.json").is_file():
        return False
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        return all((snapshot / f).is_file() for f in set(json.loads(index.read_text())["weight_map"].values()))
    return any(snapshot.glob("*.safetensors"))


def is_model_gguf(path: str) -> bool:
    """A GGUF file that is a model (llama.cpp's rule: not a projector, an importance matrix, a draft)."""
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(word in name for word in _NOT_MODELS)


def has_tag(path: str, tag: str) -> bool:
    """``path``'s file name carries the quant tag (any case), followed by '.' or '-' as llama.cpp
    reads it, and not inside a longer tag (F16 is not BF16's)."""
    name = path.rsplit("/", 1)[-1]
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(tag)}[.-]", name, re.IGNORECASE) is not None


def pick_gguf(files: list[str], tag: str | None, repo_id: str, missing_ok: bool = False) -> str | None:
    """The GGUF file of ``files`` that ``tag`` names (None: llama.cpp's default, Q4_K_M, else Q8_0,
    else the first); a ValueError for a split GGUF, and for none unless ``missing_ok``."""
    models = sorted(f for f in files if is_model_gguf(f))
    picked = None
    for t in (tag,) if tag is not None else DEFAULT_TAGS:
        picked = next((f for f in models if has_tag(f, t)), None)
        if picked is not None:
            break
    if picked is None and tag is None and models:
        picked = models[0]
    if picked is None:
        if missing_ok:
            return None
        want = f"tagged {tag!r}" if tag is not None else "file"
        raise ValueError(f"Hugging Face repository {repo_id!r} has no GGUF {want}; its GGUF files: "
                         f"{', '.join(models) or 'none'}")
    if _SPLIT.search(picked):
        raise ValueError(f"{repo_id}: {picked!r} is one part of a split GGUF (-00001-of-0000N files); "
                         f"ferry reads single-file GGUFs only: merge the parts with llama.cpp's "
                         f"llama-gguf-split --merge and pass the merged file's path")
    return picked


def download(model: str, repo_id: str, tag: str | None, cache_dir: str) -> Path:
    """Download a repository's safetensors files, or its one GGUF file, into the cache (with
    huggingface_hub's progress bar); a FileNotFoundError naming the model and the cache if it fails."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    def failed(e: Exception) -> FileNotFoundError:
        return FileNotFoundError(f"model {model!r} is not a local path and not in the Hugging Face cache "
                                 f"{cache_dir}{_what_is_cached(repo_id, tag, cache_dir)}; downloading it "
                                 f"failed: {type(e).__name__}: {e}")

    try:  # model_info, not list_repo_files: one request, no retries when there is no network
        files = [s.rfilename for s in HfApi().model_info(repo_id).siblings or []]
    except Exception as e:  # not found, gated, no network: each means the model cannot be had
        raise failed(e) from None
    gguf = pick_gguf(files, tag, repo_id) if tag is not None or not has_weights(files) else None
    try:
        if gguf is not None:
            return Path(hf_hub_download(repo_id, gguf, cache_dir=cache_dir))
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=WEIGHT_PATTERNS))
    except Exception as e:  # a download cut off or refused midway
        raise failed(e) from None


def _what_is_cached(repo_id: str, tag: str | None, cache_dir: str) -> str:
    """For an error: what the cache holds of a repository the name did not resolve in."""
    files = cached_files(repo_id, cache_dir)[1]
    if not files:
        return ""
    ggufs = [f for f in files if is_model_gguf(f)]
    if tag is not None or ggufs:
        return f" (of {repo_id} it holds the GGUF files: {', '.join(ggufs) or 'none'})"
    return f" (its snapshot of {repo_id} lacks config.json or weight files)"
