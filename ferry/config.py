"""Engine settings, named as vLLM names them. Pure Python: the core reads it too."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0")
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``--speculative-config`` spells it. ``ngram`` (prompt
    lookup): draft up to ``num_speculative_tokens`` tokens that followed an earlier occurrence
    of the request's last n tokens, n in ``[prompt_lookup_min, prompt_lookup_max]``.
    ``draft_model`` (the method when ``model`` is given): a smaller model with the same
    vocabulary (a directory, .gguf or Hugging Face name, as ``EngineConfig.model``) runs
    ``num_speculative_tokens`` steps to propose them; its KV lives in the same blocks as the
    target's (one block table, the memory budget shared).
    ``mtp``: the target's own multi-token prediction head (Qwen3.5's ``mtp.*`` tensors, or
    llama.cpp's MTP GGUF named by ``model``; ``ferry.executor.mtp``), applied recursively for
    ``num_speculative_tokens`` drafts; a verify that rejects a draft is computed again from its
    start (a recurrent state is not rewound past a token).
    ``disable_by_batch_size``: no drafts while this many requests or more are running (a
    verify step of many rows costs its compute; speculation pays where a step is bound by
    reading the weights, i.e. small batches).
    ``adaptive_k``: each step, each decoding request drafts 0 to ``num_speculative_tokens``
    tokens, as many as maximise the step's expected tokens per unit of step time, from the
    request's measured acceptance rate and ``step_cost`` (``ferry.core.spec_k``: the rule, and the
    cost model's fields); speculation turns itself off where a batch is large enough."""

    method: str | None = None  # None: "draft_model" when model is given, else "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    model: str | None = None
    adaptive_k: bool = False
    step_cost: Any = None  # a dict of ferry.core.spec_k.StepCost's fields; None: its defaults

    def __post_init__(self) -> None:
        if self.method is None:  # frozen: the resolved method is set once here
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if (self.method == "draft_model" and self.model is None) or (self.method == "ngram" and self.model is not None):
            raise ValueError("speculative_config.model names the draft model: it is needed for method "
                             f"'draft_model' and not taken by 'ngram' (method {self.method!r}, model {self.model!r})")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if v is None and name == "disable_by_batch_size":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.adaptive_k, bool):
            raise ValueError(f"speculative_config.adaptive_k must be true or false, got {self.adaptive_k!r}")
        from ferry.core.spec_k import StepCost  # pure; checks the cost model's fields

        object.__setattr__(self, "step_cost", StepCost.parse(self.step_cost, drafts_free=self.method == "ngram"))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be "
                             f"<= prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict or its JSON text (the command line's form); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**value)


@dataclass
class EngineConfig:
    """Every knob of one engine.

    ``max_num_batched_tokens`` is the token budget of one step (the ferry's
    capacity). For ``scheduler="static"``, ``max_num_seqs`` is the batch size B.
    The KV cache holds ``num_kv_blocks`` blocks of ``block_size`` tokens; when
    ``num_kv_blocks`` is None it is sized from ``kv_cache_memory_gb``.
    """

    # A directory, a .gguf file, or a Hugging Face name ORG/NAME[:QUANT] (ferry.model.hub resolves
    # it from the Hugging Face cache, or downloads it). None: the embedded SmolLM2-135M-Instruct.
    model: str | None = None
    # An image model's vision tower as llama.cpp's --mmproj GGUF, beside a text GGUF ``model``
    # (llama-server's flag). None: the one mmproj-*.gguf beside the model file, if unambiguous.
    mmproj: str | None = None
    load_format: str = "auto"  # "auto" | "dummy"
    # "auto": float32 on the CPU, bfloat16 on CUDA (float16 where bfloat16 is not supported).
    dtype: str = "auto"
    device: str = "auto"  # "auto" (CUDA when torch sees a GPU) | "cpu" | "cuda"
    # CUDA: the fraction of the GPU's memory the engine may use (weights, activations, KV cache);
    # the KV cache gets what is left (vLLM's sizing). The CPU uses kv_cache_memory_gb.
    gpu_memory_utilization: float = 0.9
    # "gguf": a GGUF model's quantized weights stay quantized (float32 activations); "none":
    # everything dequantized to dtype at load. None: "gguf" for a GGUF model, else "none".
    quantization: str | None = None
    # Quantized weights' products: "q8" quantizes activations per block of 32 to int8 for integer
    # dot products (llama.cpp's way, and its accuracy: README / `ferry bench accuracy`); "exact"
    # multiplies float32 activations, the dequantized model's results, the same tokens however
    # requests are batched (q8 is the default because it is faster at the same cost as llama.cpp).
    quant_activations: str = "q8"
    # Products done by torch (oneDNN) with float32 inputs: "ieee" computes in float32; "bf16"
    # lets oneDNN round the inputs to bfloat16 (AMX or AVX512-BF16 CPUs; float32 sums), ~3x
    # faster prefill at a small accuracy cost (README). The C kernels are float32 either way.
    fp32_matmul_precision: str = "ieee"
    # The KV cache's element type (vLLM's flag): "auto" is the model's dtype, float16 under q8
    # activations (llama.cpp's default cache beside llama.cpp's products); "bfloat16" or
    # "float16" hold K/V in half the bytes (twice the tokens in the same memory, half the bytes
    # decode attention streams), rounded once as written; "q8_0" (llama.cpp's) in 8.5 bits a
    # value; accuracy cost in README.
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 512
    # Image models: a step's vision-encoder budget in image tokens' worth of encoding (vLLM's
    # max_num_encoder_input_tokens): an image of n tokens costs n, run over as many steps as it
    # needs (the tower's blocks, and rows within a block, as pieces); a chunk ends before an image
    # whose encoding is not done by the end of its step. None: max_num_batched_tokens.
    max_num_encoder_tokens: int | None = None
    max_num_seqs: int = 128
    max_model_len: int | None = None  # None: the model's own context length
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    # Models with recurrent layers (Qwen3.5, LFM2, Mamba2 hybrids): how many per-request state slots
    # (running requests and prefix-cache snapshots share them; None: sized from the memory budget),
    # and every how many tokens a request's state is kept for the prefix cache (a multiple of
    # block_size; None: the multiple nearest above 512; a prompt's last full block is kept too).
    num_state_slots: int | None = None
    state_snapshot_interval: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    # Priority policy only. A waiting request more urgent than a running one that cannot board
    # (no KV blocks, no sequence slot, no budget) preempts the least urgent running request(s).
    priority_preemption: bool = False
    # Anti-thrashing: a request that was preempted is not a priority-preemption victim again
    # until this many steps have passed since it boarded again.
    priority_preemption_cooldown: int = 16
    # Aging: each second since arrival improves a request's effective priority by this much
    # (effective = priority - rate x seconds waited), so no request waits forever. 0: off.
    priority_aging_rate: float = 0.0
    # Caps on prompts mid-prefill at once (vLLM's names; vLLM V1 does not enforce the first two).
    # None: no cap (vLLM's default of 1 would mean one prompt at a time).
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None  # of those, how many "long" ones
    # A prompt with more tokens than this is "long", and no prefill chunk takes more. 0: off.
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    scheduler: str = "continuous"  # "continuous" | "static"
    # Reuse the KV of full blocks whose prefix was computed before (the static baseline never does).
    enable_prefix_caching: bool = True
    # None: no speculation. A SpeculativeConfig, or a dict / JSON text of one.
    speculative_config: SpeculativeConfig | None = None
    seed: int = 0
    # Tensor parallelism: the model's layers split over this many ranks (worker processes on the
    # CPU, one GPU each on CUDA), joined by torch.distributed. 1: one process.
    tensor_parallel_size: int = 1
    # How long a rank waits for the others in a collective (and the driver for a step) before the
    # engine stops with an error: a dead or hung rank never hangs the server.
    distributed_timeout_seconds: float = 300.0
    num_threads: int | None = None  # None: torch's default (with tensor parallelism: the cores / ranks)
    cache_dir: str | None = None  # where converted GGUF models are kept
    # Structured outputs: a grammar that takes longer to compile is refused (a 400 naming the field).
    max_grammar_compile_seconds: float = 10.0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        check(self.load_format in ("auto", "dummy"), "load_format", "'auto' or 'dummy'")
        check(self.quantization in (None, "gguf", "none"), "quantization", "'gguf' or 'none'")
        check(self.quant_activations in ("exact", "q8"), "quant_activations", "'exact' or 'q8'")
        check(self.fp32_matmul_precision in ("ieee", "bf16"), "fp32_matmul_precision", "'ieee' or 'bf16'")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", ", ".join(map(repr, KV_CACHE_DTYPES)))
        check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
              "'auto', 'float32', 'bfloat16' or 'float16'")
        check(self.device in ("auto", "cpu", "cuda"), "device", "'auto', 'cpu' or 'cuda'")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "in (0, 1]")
        check(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
              "max_num_batched_tokens", "an integer >= 1")
        check(self.max_num_encoder_tokens is None or (
              isinstance(self.max_num_encoder_tokens, int) and self.max_num_encoder_tokens >= 1),
              "max_num_encoder_tokens", "an integer >= 1")
        check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1")
        check(isinstance(self.block_size, int) and self.block_size >= 1, "block_size", "an integer >= 1")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1")
        check(self.num_state_slots is None or (isinstance(self.num_state_slots, int) and self.num_state_slots >= 1),
              "num_state_slots", "an integer >= 1")
        check(self.state_snapshot_interval is None or (
              isinstance(self.state_snapshot_interval, int) and self.state_snapshot_interval >= 1
              and self.state_snapshot_interval % self.block_size == 0),
              "state_snapshot_interval", f"a positive multiple of block_size ({self.block_size})")
        check(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "> 0")
        check(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "'fcfs' or 'priority'")
        check(self.scheduler in ("continuous", "static"), "scheduler", "'continuous' or 'static'")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              "tensor_parallel_size", "an integer >= 1")
        check(self.distributed_timeout_seconds > 0, "distributed_timeout_seconds", "> 0")
        check(0 < self.max_grammar_compile_seconds < float("inf"), "max_grammar_compile_seconds", "> 0")
        self._check_policies(check)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        spec = self.speculative_config
        if spec is not None and spec.method == "mtp" and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config method 'mtp' runs on one rank: tensor_parallel_size must be 1")
        if self.draft_model is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config with a draft model runs on one rank: "
                             "tensor_parallel_size must be 1")

    @property
    def draft_model(self) -> str | None:
        """The draft model speculation runs (``speculative_config.model``), or None."""
        spec = self.speculative_config
        return spec.model if spec is not None and spec.method == "draft_model" else None

    def _check_policies(self, check: Any) -> None:
        def positive_or_none(name: str) -> None:
            v = getattr(self, name)
            check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1), name,
                  "an integer >= 1 (or unset: no cap)")

        cooldown, rate = self.priority_preemption_cooldown, self.priority_aging_rate
        check(isinstance(cooldown, int) and not isinstance(cooldown, bool) and cooldown >= 0,
              "priority_preemption_cooldown", "an integer >= 0 (steps)")
        check(isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate < float("inf"),
              "priority_aging_rate", "a finite number >= 0 (priority levels per second)")
        positive_or_none("max_num_partial_prefills")
        positive_or_none("max_long_partial_prefills")
        check(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
              "long_prefill_token_threshold", "an integer >= 0 (0: off)")
        if self.scheduling_policy != "priority":
            for name in ("priority_preemption", "priority_aging_rate"):
                if getattr(self, name):
                    raise ValueError(f"{name} needs scheduling_policy='priority' "
                                     f"(got {self.scheduling_policy!r})")
        if self.max_long_partial_prefills is not None and not self.long_prefill_token_threshold:
            raise ValueError("max_long_partial_prefills needs long_prefill_token_threshold > 0 "
                             "(the prompt length above which a prompt is long)")
        if self.max_long_partial_prefills is not None and self.max_num_partial_prefills is not None \
                and self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold caps prefill chunks: it needs enable_chunked_prefill")
        if self.scheduler == "static":
            for name in ("priority_preemption", "max_num_partial_prefills", "max_long_partial_prefills",
                         "long_prefill_token_threshold"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to the continuous scheduler, not scheduler='static'")

    @property
    def has_prefill_caps(self) -> bool:
        return bool(self.max_num_partial_prefills or self.max_long_partial_prefills)

    @property
    def snapshot_interval(self) -> int:
        """Every how many tokens a recurrent state is kept for the prefix cache (``state_snapshot_interval``)."""
        if self.state_snapshot_interval is not None:
            return self.state_snapshot_interval
        return -(-512 // self.block_size) * self.block_size

    def check_model_len(self) -> None:
        """Checks that need max_model_len resolved (after the model's config is read)."""
        assert self.max_model_len is not None
        if not self.enable_chunked_prefill and self.scheduler == "continuous" \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill=False a whole prompt must fit one step: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}); raise the budget or lower max_model_len")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}")
        return cls(**kwargs)
