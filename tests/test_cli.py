"""The ferry command, run as a user would."""
from __future__ import annotations

import subprocess
import sys


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferry.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_completion(llm):
    p = run("generate", "The capital of France is", "--max-tokens", "8")
    assert p.returncode == 0, p.stderr
    expected = llm.generate("The capital of France is", __import__("ferry").SamplingParams(
        temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert p.stdout.strip() == expected.strip()


def test_chat_streams_a_reply_and_exits_on_eof():
    p = run("chat", "--max-tokens", "16", stdin="Name the capital city of France.\n")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout


def test_bad_setting_is_an_error_message_not_a_traceback():
    p = run("generate", "hi", "--max-num-batched-tokens", "0")
    assert p.returncode == 2 and "max_num_batched_tokens must be" in p.stderr
    assert "Traceback" not in p.stderr


# The packages only the extras install ('server', 'bench', 'ray', 'test'), made unimportable.
WITHOUT_EXTRAS = """
import importlib.abc, sys
BLOCKED = {"fastapi", "starlette", "uvicorn", "prometheus_client", "httpx", "jsonschema", "matplotlib", "ray",
           "pytest", "hypothesis", "openai", "anthropic", "agents", "selenium"}
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from ferry.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_extras(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *args], capture_output=True, text=True, timeout=300)


def test_the_core_install_generates_and_names_the_extra_a_command_needs(tmp_path):
    """`pip install ferry` without extras: the engine runs; a command that needs an extra says which."""
    p = run_without_extras("--help")
    assert p.returncode == 0, p.stderr
    assert "serve an OpenAI-compatible HTTP server (not installed: pip install 'ferry[server]')" in \
        " ".join(p.stdout.split())
    p = run_without_extras("generate", "The capital of France is", "--max-tokens", "4")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    p = run_without_extras("serve", "--port", "1")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == ("ferry: error: ferry serve needs the package 'uvicorn', which is not installed: "
                                "pip install 'ferry[server]'")
    p = run_without_extras("simulate", "--model", "qwen2.5-7b", "--hardware", "a100-80gb", "--num-prompts", "4",
                           "--request-rate", "5", "--no-progress", "--plot", str(tmp_path))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "plots needs the package 'matplotlib', which is not installed: pip install 'ferry[bench]'" in p.stderr


def test_the_batching_report_commands_are_named_for_what_they_report():
    for command in (["bench", "batching-report"], ["simulate", "batching-report"]):
        p = run(*command, "--help")
        assert p.returncode == 0, p.stderr
        assert "--quick" in p.stdout and "--only" in p.stdout
    p = run("bench", "seed", "--help")
    assert p.returncode == 2 and "invalid choice: 'seed'" in p.stderr
