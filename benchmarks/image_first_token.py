"""First token of a prompt with one image: ferry against llama.cpp's `llama-server --mmproj`, alternated.

Both run the same text GGUF and mmproj GGUF with 2 threads on images of the same size and kind
(deterministic noise); no run reuses an encoding. ferry: `ferry bench offline` (one request of an
image and ``--input-len`` text tokens, one output token; each run starts with its prefix and encoder
caches cold), its median TTFT over ``--num-runs``. llama.cpp: `llama-server`, started once per pass (its loading and a first
request excluded), then ``--num-runs`` chat completions of one image and a short question with
``max_tokens`` 1 and its prompt cache off; its first token is each request's wall time (the image's
decoding, encoding and the prompt's evaluation), the median taken. Prints each pass and the medians.

    python benchmarks/image_first_token.py --model text-Q4_K_M.gguf --mmproj mmproj-F16.gguf \\
        --llama-bin $LLAMA_CPP/build/bin --repeats 3 --llama-args=-nr
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ferry.bench.images import bench_image

PROMPT = "Describe this picture in one short sentence, naming its main colours and shapes."


def ferry_ttft(args: argparse.Namespace, out: Path) -> float:
    """ferry's median TTFT (s) of one invocation of `ferry bench offline`."""
    cmd = [sys.executable, "-m", "ferry.cli", "bench", "offline", "--model", args.model, "--mmproj", args.mmproj,
           "--num-prompts", "1", "--input-len", str(args.input_len), "--output-len", "1",
           "--image-size", f"{args.size}x{args.size}", "--num-runs", str(args.num_runs), "--no-progress",
           "--output-json", str(out), *args.ferry_args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())["median_ttft_ms"] / 1e3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def llama_ttft(args: argparse.Namespace, first_pattern: int) -> tuple[float, int]:
    """llama.cpp's (median first-token s, prompt tokens) over ``--num-runs`` requests to one `llama-server`."""
    port = _free_port()
    cmd = [str(Path(args.llama_bin) / "llama-server"), "-m", args.model, "--mmproj", args.mmproj, "-t", "2",
           "-c", "4096", "-np", "1", "--host", "127.0.0.1", "--port", str(port), *args.llama_args.split()]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {server.returncode}: {' '.join(cmd)}")
                time.sleep(1)
        times, tokens = [], 0
        for k in range(args.num_runs + 1):  # the first request warms the server up
            buf = io.BytesIO()
            bench_image(args.size, args.size, first_pattern + k).save(buf, "PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                              {"type": "text", "text": PROMPT}]}],
                    "max_tokens": 1, "temperature": 0, "cache_prompt": False}
            req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            reply = json.loads(urllib.request.urlopen(req, timeout=600).read())
            if k:
                times.append(time.perf_counter() - t0)
            tokens = reply["usage"]["prompt_tokens"]
        return statistics.median(times), tokens
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the text GGUF")
    p.add_argument("--mmproj", required=True, help="the vision tower's mmproj GGUF")
    p.add_argument("--llama-bin", required=True, help="llama.cpp's build/bin")
    p.add_argument("--size", type=int, default=448, help="the image's side in pixels")
    p.add_argument("--input-len", type=int, default=40, help="ferry's text tokens beside the image")
    p.add_argument("--num-runs", type=int, default=3, help="ferry's runs per invocation (median)")
    p.add_argument("--repeats", type=int, default=3, help="alternated invocations of each")
    p.add_argument("--llama-args", default="", help="more `llama-server` arguments, one string (e.g. \"-nr\")")
    p.add_argument("--ferry-args", nargs=argparse.REMAINDER, default=[], help="more `ferry bench` arguments")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ferry, llama = [], []
        for i in range(args.repeats):
            f = ferry_ttft(args, Path(tmp) / "ferry.json")
            total, n = llama_ttft(args, 1000 * (i + 1))
            ferry.append(f)
            llama.append(total)
            print(f"pass {i + 1}: ferry {f:.3f} s | llama.cpp {total:.3f} s ({n} prompt tokens)", flush=True)
    fm, lm = statistics.median(ferry), statistics.median(llama)
    print(f"median first token: ferry {fm:.3f} s, llama.cpp {lm:.3f} s (ferry at {fm / lm:.2f}x llama.cpp's time)")


if __name__ == "__main__":
    main()
