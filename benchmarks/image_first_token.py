"""First token of a prompt with one image: ferry against llama.cpp's `llama-mtmd-cli`, alternated.

Both run the same text GGUF and mmproj GGUF on the same image (a deterministic pattern, written to
a PNG for llama.cpp) with 2 threads. ferry: `ferry bench offline` (one request of the image and
``--input-len`` text tokens, one output token), its median TTFT over ``--num-runs``. llama.cpp:
`llama-mtmd-cli -n 1` with a chat prompt of about as many tokens; its first token is the image's
encoding ("image slice encoded in") plus its prompt evaluation (``llama_perf_context_print``:
the image rows and the text), both as it prints them (model loading and its warm-up excluded, as
ferry's TTFT excludes them). Prints each invocation and the medians.

    python benchmarks/image_first_token.py --model text-Q4_K_M.gguf --mmproj mmproj-F16.gguf \\
        --llama-bin $LLAMA_CPP/build/bin --repeats 3
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
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


def llama_ttft(args: argparse.Namespace, image: Path) -> tuple[float, float, float, int]:
    """llama.cpp's (first-token s, encode s, prompt eval s, prompt tokens) of one `llama-mtmd-cli` run."""
    cmd = [str(Path(args.llama_bin) / "llama-mtmd-cli"), "-m", args.model, "--mmproj", args.mmproj,
           "--image", str(image), "-p", PROMPT, "-n", "1", "-t", "2", "--temp", "0", "-c", "4096", *args.llama_args.split()]
    p = subprocess.run(cmd, capture_output=True, text=True)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        raise RuntimeError(f"llama-mtmd-cli failed:\n{log[-3000:]}")
    # Older builds print each slice's time, newer ones the whole batch's.
    enc = sum(float(m) for m in re.findall(r"(?:image slice encoded in|mtmd batch encoding done in) (\d+) ms", log)) / 1e3
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log)
    if m is None or not enc:
        raise RuntimeError(f"no timings in llama-mtmd-cli's output:\n{log[-3000:]}")
    return enc + float(m.group(1)) / 1e3, enc, float(m.group(1)) / 1e3, int(m.group(2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the text GGUF")
    p.add_argument("--mmproj", required=True, help="the vision tower's mmproj GGUF")
    p.add_argument("--llama-bin", required=True, help="llama.cpp's build/bin")
    p.add_argument("--size", type=int, default=448, help="the image's side in pixels")
    p.add_argument("--input-len", type=int, default=40, help="ferry's text tokens beside the image")
    p.add_argument("--num-runs", type=int, default=3, help="ferry's runs per invocation (median)")
    p.add_argument("--repeats", type=int, default=3, help="alternated invocations of each")
    p.add_argument("--llama-args", default="", help="more `llama-mtmd-cli` arguments, one string (e.g. \"-nr\")")
    p.add_argument("--ferry-args", nargs=argparse.REMAINDER, default=[], help="more `ferry bench` arguments")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "image.png"
        bench_image(args.size, args.size, 0).save(image)
        ferry, llama = [], []
        for i in range(args.repeats):
            f = ferry_ttft(args, Path(tmp) / "ferry.json")
            total, enc, ev, n = llama_ttft(args, image)
            ferry.append(f)
            llama.append(total)
            print(f"pass {i + 1}: ferry {f:.3f} s | llama.cpp {total:.3f} s (encode {enc:.3f} s + prompt eval "
                  f"{ev:.3f} s of {n} tokens)", flush=True)
    fm, lm = statistics.median(ferry), statistics.median(llama)
    print(f"median first token: ferry {fm:.3f} s, llama.cpp {lm:.3f} s (ferry at {fm / lm:.2f}x llama.cpp's time)")


if __name__ == "__main__":
    main()
