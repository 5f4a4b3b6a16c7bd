"""Models by Hugging Face name: ``ORG/NAME`` and ``ORG/NAME:QUANT`` read from a Hugging Face cache
laid out here as huggingface_hub lays out a download (the tests never reach the hub)."""
from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ferry import LLM, SamplingParams
from ferry.model.gguf_convert import embedded_gguf_path
from ferry.model.loader import gguf_file, resolve_model_dir

REPO = "ferry-test/SmolLM2-135M-Instruct"  # a safetensors repository: the embedded model converted
GGUF_REPO = "ferry-test/SmolLM2-135M-Instruct-GGUF"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the embedded GGUF, under its own name
PROMPT = "The capital of France is"
# Small repositories of stand-in GGUF files, for which file a name picks.
PICK_REPOS = {
    "ferry-test/q8-and-q4": ["m.Q4_1.gguf", "m.Q8_0.gguf"],
    "ferry-test/no-default": ["a-mmproj-f16.gguf", "m.Q5_K_S.gguf", "m.Q4_1.gguf"],
    "ferry-test/half": ["m-BF16.gguf", "m-F16.gguf"],
    "ferry-test/split": ["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"],
}
COMMIT = hashlib.sha1(b"ferry-test").hexdigest()
HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja")


def link_or_copy(src: Path, dst: Path) -> None:
    try:  # the same bytes without copying hundreds of MB
        os.link(src, dst)
    except OSError:
        dst.write_bytes(src.read_bytes())


def put_in_cache(cache: Path, repo_id: str, files: dict[str, Path | bytes]) -> None:
    """Lay ``files`` out as huggingface_hub's cache holds a downloaded model repository:
    models--ORG--NAME/blobs/ named by etag (sha256 for LFS files, git's blob hash for the others),
    snapshots/<commit>/ of relative links to the blobs, refs/main holding the commit."""
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        data = src if isinstance(src, bytes) else None
        lfs = name.endswith((".gguf", ".safetensors"))
        if data is None and lfs:
            with open(src, "rb") as f:
                etag = sha_fileobj(f).hex()
        else:
            data = data if data is not None else Path(src).read_bytes()
            etag = hashlib.sha256(data).hexdigest() if lfs else git_hash(data)
        blob = storage / "blobs" / etag
        if data is not None:
            blob.write_bytes(data)
        else:
            link_or_copy(Path(src), blob)
        pointer = storage / "snapshots" / COMMIT / name
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(COMMIT)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, embedded_dir) -> Path:
    """The embedded model converted, as a Hugging Face repository holds it (the conversion's
    directory also keeps ferry's cache of quantized weights)."""
    out = tmp_path_factory.mktemp("hf-dir")
    for name in HF_FILES:
        if (embedded_dir / name).is_file():
            link_or_copy(embedded_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory, hf_dir) -> Path:
    """A Hugging Face cache of the test repositories, checked with huggingface_hub's own scan."""
    from huggingface_hub import scan_cache_dir

    cache = tmp_path_factory.mktemp("hf-hub")
    put_in_cache(cache, REPO, {p.name: p for p in hf_dir.iterdir()})
    put_in_cache(cache, GGUF_REPO, {GGUF_NAME: embedded_gguf_path(),
                                    "SmolLM2-135M-Instruct.Q4_K_M.gguf": b"GGUF not a model",
                                    "README.md": b"# test\n"})
    for repo_id, names in PICK_REPOS.items():
        put_in_cache(cache, repo_id, {n: f"GGUF {repo_id} {n}".encode() for n in names})
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    seen = {r.repo_id: {f.file_name for rev in r.revisions for f in rev.files} for r in info.repos}
    assert seen[REPO] >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert seen[GGUF_REPO] == {GGUF_NAME, "SmolLM2-135M-Instruct.Q4_K_M.gguf", "README.md"}
    assert all(seen[r] == set(n) for r, n in PICK_REPOS.items())
    return cache


@pytest.fixture
def offline(hf_cache, monkeypatch) -> Path:
    """The test cache as huggingface_hub's, with HF_HUB_OFFLINE set (its constants are read at import)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_cache


@pytest.fixture
def unreachable_hub(hf_cache, monkeypatch) -> Path:
    """The test cache, not offline, with the hub at an address nothing listens on."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    return hf_cache


def greedy(model: str) -> tuple[list[int], str]:
    """The greedy completion of PROMPT by ``model``: its token ids and text."""
    llm = LLM(model=model, num_kv_blocks=32)
    try:
        out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), out.text
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def gguf_file_greedy() -> tuple[list[int], str]:
    """The embedded GGUF's greedy completion, loaded by its path."""
    return greedy(str(embedded_gguf_path()))


def test_a_safetensors_repository_by_name_generates_what_its_directory_does(offline, hf_dir):
    model_dir = resolve_model_dir(REPO)
    assert model_dir == offline / "models--ferry-test--SmolLM2-135M-Instruct" / "snapshots" / COMMIT
    assert greedy(REPO) == greedy(str(hf_dir))


def test_a_local_path_wins_over_the_same_name(offline, hf_dir, tmp_path, monkeypatch):
    assert resolve_model_dir(REPO).is_relative_to(offline)
    local = tmp_path / REPO
    local.mkdir(parents=True)
    (local / "config.json").write_text((hf_dir / "config.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir(REPO) == Path(REPO)


def test_a_quant_tag_picks_that_gguf_and_generates_what_the_file_does(offline, gguf_file_greedy):
    for tag in ("Q4_1", "q4_1"):  # the tag in any case
        path = gguf_file(f"{GGUF_REPO}:{tag}")
        assert path is not None and path.name == GGUF_NAME and path.is_relative_to(offline)
    assert greedy(f"{GGUF_REPO}:Q4_1") == gguf_file_greedy


@pytest.mark.parametrize("name, picked", [
    (GGUF_REPO, "SmolLM2-135M-Instruct.Q4_K_M.gguf"),  # no tag: Q4_K_M first
    ("ferry-test/q8-and-q4", "m.Q8_0.gguf"),  # then Q8_0
    ("ferry-test/no-default", "m.Q4_1.gguf"),  # then the first model file (not the projector)
    ("ferry-test/half:F16", "m-F16.gguf"),  # a tag is not part of a longer one (BF16)
])
def test_which_gguf_a_name_picks(offline, name, picked):
    path = gguf_file(name)
    assert path is not None and path.name == picked


def test_a_split_gguf_is_refused_clearly(offline):
    with pytest.raises(ValueError, match=r"ferry-test/split: 'm-Q4_K_M-00001-of-00002.gguf' is one part of a "
                                         r"split GGUF .* single-file GGUFs only"):
        gguf_file("ferry-test/split")


def test_an_unknown_name_offline_says_it_is_not_in_the_cache(offline):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir("nobody/no-such-model")
    msg = str(e.value)
    assert "model 'nobody/no-such-model' is not a local path and not in the Hugging Face cache" in msg
    assert str(offline) in msg
    assert "HF_HUB_OFFLINE" in msg


def test_a_tag_the_cached_repository_lacks_names_the_cached_files(offline):
    with pytest.raises(FileNotFoundError, match=r"'ferry-test/q8-and-q4:Q6_K' is not a local path and not in "
                                                r"the Hugging Face cache .* \(of ferry-test/q8-and-q4 it holds "
                                                r"the GGUF files: m.Q4_1.gguf, m.Q8_0.gguf\)"):
        gguf_file("ferry-test/q8-and-q4:Q6_K")


def test_a_cached_name_needs_no_network(unreachable_hub):
    path = gguf_file(f"{GGUF_REPO}:Q4_1")
    assert path is not None and path.name == GGUF_NAME and path.is_relative_to(unreachable_hub)


def test_a_name_neither_cached_nor_downloadable_names_the_model_and_the_cache(unreachable_hub):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_dir("nobody/no-such-model:Q4_K_M")
    msg = str(e.value)
    assert "model 'nobody/no-such-model:Q4_K_M' is not a local path" in msg and str(unreachable_hub) in msg
    assert "downloading it failed" in msg


def test_the_cli_generates_with_a_model_name(hf_cache, gguf_file_greedy):
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "ferry.cli", "generate", PROMPT, "--model", f"{GGUF_REPO}:Q4_1",
                        "--max-tokens", "8", "--num-kv-blocks", "32"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == gguf_file_greedy[1].strip()
    p = subprocess.run([sys.executable, "-m", "ferry.cli", "generate", PROMPT, "--model", "nobody/no-such-model"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2 and "'nobody/no-such-model' is not a local path and not in the Hugging Face cache" \
        in p.stderr
    assert "Traceback" not in p.stderr
