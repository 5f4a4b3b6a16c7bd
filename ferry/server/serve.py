"""``ferry serve``: load the model, start the step loop, serve HTTP until SIGTERM/SIGINT."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from ferry.config import EngineConfig

if TYPE_CHECKING:
    from ferry.engine.async_engine import AsyncEngine
    from ferry.multimodal.images import ImageLimits
    from ferry.server.context import ChatLimits
    from ferry.server.model_pool import PoolSettings
    from ferry.server.replicas import ReplicaSet

DEFAULT_NAME = "SmolLM2-135M-Instruct"
log = logging.getLogger("ferry.serve")


def add_server_args(p: argparse.ArgumentParser) -> None:
    from ferry.server.app import DEFAULT_MAX_REQUEST_BYTES
    from ferry.server.context import ChatLimits
    from ferry.server.json_body import DEFAULT_MAX_JSON_VALUES
    from ferry.server.reasoning import REASONING_PARSERS
    from ferry.server.tools.parsers import PARSERS

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", help="the model id clients send (default: the model's directory name)")
    g.add_argument("--api-key", default=os.environ.get("FERRY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or x-api-key: KEY) on every route but /health "
                        "and /metrics (or set FERRY_API_KEY)")
    g.add_argument("--max-waiting-requests", type=int, default=512,
                   help="past this many waiting requests, new ones get 503 with Retry-After")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are refused with 413 (default: 8 MiB)")
    g.add_argument("--max-request-json-values", type=int, default=DEFAULT_MAX_JSON_VALUES,
                   help="request bodies with more JSON values are refused with 413 before they are parsed "
                        f"(parsing holds up every request; default: {DEFAULT_MAX_JSON_VALUES:,})")
    g.add_argument("--allowed-origins", default=None,
                   help="comma-separated origins allowed by CORS, or '*' (default: CORS off)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds to let requests in flight finish before aborting them")
    g.add_argument("--log-level", default="info")
    g.add_argument("--tool-call-parser", default=None,
                   choices=sorted(PARSERS),
                   help="the format the model writes tool calls in (default: read from the chat template)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's <think>...</think> text into reasoning_content (default: off)")
    limits = ChatLimits()
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat templates that requests bring (chat_template, or chat_template_kwargs."
                        "chat_template); without it they are refused with 400. A template is code: each render "
                        "is bounded by the two settings below, in a process of its own")
    g.add_argument("--max-chat-template-seconds", type=float, default=limits.max_template_seconds,
                   help="a chat template render (the model's or a request's) that takes longer is cancelled, "
                        f"and its request refused with 400 (default: {limits.max_template_seconds:g})")
    g.add_argument("--max-chat-template-chars", type=int, default=limits.max_template_chars,
                   help="a chat template render with a longer output is refused with 400 "
                        f"(default: {limits.max_template_chars:,})")
    g.add_argument("--max-tools", type=int, default=limits.max_tools,
                   help=f"a request with more tools is refused with 400 (default: {limits.max_tools}, OpenAI's)")
    g.add_argument("--max-tools-bytes", type=int, default=limits.max_tools_bytes,
                   help="a request whose tools' JSON is larger, all together, is refused with 400 "
                        f"(default: {limits.max_tools_bytes:,})")
    add_image_args(p)
    add_model_pool_args(p)
    from ferry.server.router import add_router_args

    add_router_args(p)
    p.add_argument("--ray-address", default=None,
                   help="with --data-parallel-size > 1: the Ray cluster to join ('auto', or host:port); "
                        "default: start a local one")


def add_image_args(p: argparse.ArgumentParser) -> None:
    """What a request's images may be (a model that takes images; a text-only one refuses them with 400)."""
    from ferry.multimodal.images import ImageLimits

    d = ImageLimits()
    g = p.add_argument_group("images (every bad image is refused with 400 naming its field)")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar='\'{"image": N}\'',
                   help=f"at most N images in one request, as JSON (vLLM's form) or image=N (default: {d.max_images})")
    g.add_argument("--max-image-pixels", type=int, default=d.max_pixels,
                   help="an image of more pixels (width x height, read from its header before it is decoded) "
                        f"is refused (default: {d.max_pixels:,})")
    g.add_argument("--enable-image-urls", action="store_true",
                   help="fetch images given as http(s) URLs (default: off, only data: URLs and base64 are taken); "
                        "see --allowed-media-domains")
    g.add_argument("--allowed-media-domains", default=None, metavar="HOST[,HOST...]",
                   help="with --enable-image-urls: fetch only from these hosts, exactly as named; redirects "
                        "too (default: any host)")
    g.add_argument("--image-url-max-bytes", type=int, default=d.url_max_bytes,
                   help=f"a fetched image larger than this is refused (default: {d.url_max_bytes:,})")
    g.add_argument("--image-url-timeout", type=float, default=d.url_timeout,
                   help="a fetch that takes longer, all of it, is refused (seconds; "
                        f"default: {d.url_timeout:g})")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="take file:// image URLs of files under DIR (a risk: requests read the server's "
                        "files; default: none)")


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The image settings on the command line (ValueError naming a bad one)."""
    from ferry.multimodal.images import ImageLimits

    max_images = ImageLimits().max_images
    if args.limit_mm_per_prompt is not None:
        max_images = images_per_prompt(args.limit_mm_per_prompt)
    domains = tuple(d.strip().lower() for d in (args.allowed_media_domains or "").replace(" ", ",").split(",")
                    if d.strip())
    if args.allowed_local_media_path is not None and not Path(args.allowed_local_media_path).is_dir():
        raise ValueError(f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a directory")
    try:
        return ImageLimits(args.max_image_pixels, max_images, args.enable_image_urls, args.image_url_max_bytes,
                           args.image_url_timeout, domains, args.allowed_local_media_path)
    except ValueError as e:  # ImageLimits names its field: say the flag
        flag = {"max_pixels": "--max-image-pixels", "max_images": "--limit-mm-per-prompt",
                "url_max_bytes": "--image-url-max-bytes", "url_timeout": "--image-url-timeout"}
        name = str(e).split(" ", 1)[0]
        raise ValueError(f"{flag.get(name, name)}{str(e)[len(name):]}") from None


def images_per_prompt(value: str) -> int:
    """The image count of --limit-mm-per-prompt: '{"image": N}' or image=N."""
    import json

    try:
        spec = json.loads(value) if value.strip().startswith("{") else dict([value.split("=", 1)])
        count = int(spec["image"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--limit-mm-per-prompt must be '{{\"image\": N}}' or image=N, got {value!r}") from None
    return count


def add_model_pool_args(p: argparse.ArgumentParser) -> None:
    """Several models behind one server (``model_pool.py``), as llama-server's router mode serves them."""
    from ferry.server.model_pool import PoolSettings

    d = PoolSettings()
    g = p.add_argument_group("several models (--model repeated, or --models-dir): each loaded on its "
                             "first request, as its own engine; requests must name theirs in 'model'")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model directly under DIR: each directory with a config.json and each "
                        ".gguf file (not mmproj-*), named by its directory's or file's name (GET /v1/models "
                        "lists them); with --model too, those as well")
    g.add_argument("--max-loaded-models", type=int, default=d.max_loaded, metavar="N",
                   help="at most N models loaded at once: loading one more first unloads the least recently "
                        f"used model with no request in flight (default: {d.max_loaded})")
    g.add_argument("--models-memory-gb", type=float, default=None, metavar="GB",
                   help="at most this much memory (GiB) for the loaded models, each counted as its weights' "
                        "file size plus its KV cache budget (--kv-cache-memory-gb); past it, as above "
                        "(default: no budget)")
    g.add_argument("--idle-unload-seconds", type=float, default=None, metavar="S",
                   help="unload a model that no request has used for S seconds (default: never)")
    g.add_argument("--model-load-timeout", type=float, default=d.load_timeout_s, metavar="S",
                   help="a request waits at most S seconds for its model to load (or for room to load it), "
                        f"then gets 503 with Retry-After; the load goes on (default: {d.load_timeout_s:g})")


def model_sources(models: list[str] | None, models_dir: str | None) -> list[str | None]:
    """The models to serve: each --model (none given and no --models-dir: the embedded one), then
    every model directly under ``models_dir``, sorted by name."""
    from ferry.model.hub import is_model_gguf

    sources: list[str | None] = list(models or ([] if models_dir else [None]))
    if models_dir is not None:
        root = Path(models_dir).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"--models-dir {models_dir!r} is not a directory")
        found = [str(path) for path in sorted(root.iterdir())
                 if (path.is_dir() and (path / "config.json").is_file())
                 or (path.is_file() and is_model_gguf(path.name))]
        if not found:
            raise FileNotFoundError(f"--models-dir {models_dir!r} holds no model (a directory with a "
                                    f"config.json, or a .gguf file)")
        sources += found
    return sources


def served_name(model: str | None) -> str:
    """The id clients send by default: a Hugging Face name as given (as vLLM serves it), else
    the directory's or file's name."""
    from ferry.model.hub import is_hub_name

    if model is None:
        return DEFAULT_NAME
    return model if is_hub_name(model) else Path(model).expanduser().absolute().name


def cmd_serve(args: argparse.Namespace, config: EngineConfig) -> int:
    from ferry.server.app import build_app
    from ferry.server.model_pool import ModelEntry, ModelPool

    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.max_request_json_values < 1:
        raise ValueError(f"--max-request-json-values must be >= 1, got {args.max_request_json_values}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    limits = chat_limits(args)  # before the model loads: a bad flag fails at once
    settings = pool_settings(args)
    sources = model_sources(model_flags(args), args.models_dir)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    build = partial(build_engine, max_waiting_requests=args.max_waiting_requests)
    if len(sources) == 1 and args.models_dir is None:  # one model, loaded now: a pool of one
        config = replace(config, model=sources[0])
        name = args.served_model_name or served_name(config.model)
        front, where = one_front(args, config, name)
        replicas = args.data_parallel_size > 1
        if replicas and settings.idle_unload_s is not None:
            raise ValueError("--idle-unload-seconds unloads a model to load it again on request: not with "
                             "--data-parallel-size > 1")
        pool = ModelPool.of_one(name, front, config, settings, None if replicas else build)
        serving = f"{name!r}"
        where = f"{where}, max_model_len {front.max_model_len}"
    else:
        if args.served_model_name:
            raise ValueError("--served-model-name names the one model served; with several, each is named "
                             "by its directory's or file's name")
        if args.data_parallel_size > 1:
            raise ValueError("--data-parallel-size > 1 serves one model: not with several --model or --models-dir")
        pool = ModelPool([ModelEntry(served_name(source), replace(config, model=source)) for source in sources],
                         settings, build)
        serving = f"{len(pool.entries)} models ({', '.join(pool.entries)})"
        where = "each loaded on its first request"
    origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()] if args.allowed_origins else None
    app = build_app(pool, None, args.api_key, args.max_request_bytes, origins, args.tool_call_parser,
                    args.reasoning_parser, limits, args.max_request_json_values)
    print(f"ferry: serving {serving} on http://{args.host}:{args.port} ({where})", flush=True)
    # uvicorn re-raises the signal that stopped it to the handler that was there before it; a no-op
    # one makes the orderly shutdown exit 0, as a supervisor expects.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5),
                            pool, args.shutdown_timeout)
    server.run()
    return 0


def model_flags(args: argparse.Namespace) -> list[str] | None:
    """The --model flags given (repeatable), or None."""
    models = args.model
    return [models] if isinstance(models, str) else models


def build_engine(config: EngineConfig, max_waiting_requests: int | None = None) -> AsyncEngine:
    """One model's engine, loaded (its step loop starts with ``start``)."""
    from ferry.engine.async_engine import AsyncEngine
    from ferry.engine.llm_engine import LLMEngine

    return AsyncEngine(lambda: LLMEngine.from_config(config), max_waiting_requests)


def one_front(args: argparse.Namespace, config: EngineConfig, name: str) -> tuple[AsyncEngine | ReplicaSet, str]:
    """The one model's engine, or its data-parallel replicas, and what to say of it."""
    if args.data_parallel_size > 1:
        from ferry.server.replicas import ReplicaSet
        from ferry.server.router import RouterConfig

        front = ReplicaSet(config, args.data_parallel_size, RouterConfig(policy=args.router_policy), name,
                           args.max_waiting_requests, args.ray_address)
        return front, (f"{args.data_parallel_size} replicas on Ray, {front.infos[0]['num_kv_blocks']} KV blocks "
                       f"each, router {args.router_policy}")
    front = build_engine(config, args.max_waiting_requests)
    return front, f"{front.engine.num_kv_blocks} KV blocks"


def pool_settings(args: argparse.Namespace) -> PoolSettings:
    """The settings of several models on the command line (ValueError naming a bad one)."""
    from ferry.server.model_pool import PoolSettings

    return PoolSettings(args.max_loaded_models, args.models_memory_gb, args.idle_unload_seconds,
                        args.model_load_timeout)


def chat_limits(args: argparse.Namespace) -> ChatLimits:
    """The chat settings on the command line (ValueError naming a bad one)."""
    from ferry.server.context import ChatLimits

    return ChatLimits(args.trust_request_chat_template, args.max_chat_template_seconds,
                      args.max_chat_template_chars, args.max_tools, args.max_tools_bytes, image_limits(args))


class DrainingServer(uvicorn.Server):
    """uvicorn's server with ferry's shutdown: on the first SIGTERM/SIGINT, refuse new requests
    (503), let those in flight finish for ``shutdown_timeout`` seconds, then abort the rest, whose
    streams end with an error event and [DONE] and whose plain requests get a 503; only then
    does uvicorn close. A second signal stops at once."""

    def __init__(self, config, engine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining:
            return super().handle_exit(sig, frame)
        self.draining = True
        self.engine.draining = True
        threading.Thread(target=self._drain, name="ferry-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine.num_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        aborted = self.engine.abort_all()
        if aborted:
            log.warning("shutdown: %d request(s) still running after %.0f s were aborted", aborted,
                        self.shutdown_timeout)
        else:
            log.info("shutdown: every request in flight finished")
        time.sleep(0.2)  # let the aborted streams send their last events
        self.should_exit = True
