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
