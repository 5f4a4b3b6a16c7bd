"""The model executor: load the model, hold the KV cache, run one packed step, sample."""
from __future__ import annotations

import logging

import numpy as np
import torch

from ferry.config import EngineConfig
from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.executor.batch import pack
from ferry.executor.sampler import Sampler
from ferry.model.config import ModelConfig
from ferry.model.llama import LlamaModel
from ferry.model.loader import DTYPES, dummy_weights, load_safetensors, resolve_model_dir
from ferry.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class ModelExecutor:
    """Runs the real model. Resolves ``config.max_model_len`` and sizes the KV cache."""

    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = DTYPES[config.dtype]
        if dtype is not torch.float32:
            try:
                torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
            except RuntimeError as e:
                raise ValueError(f"dtype {config.dtype!r} is not supported on this device: {e}") from None
        model_dir = resolve_model_dir(config.model, config.cache_dir)
        cfg = ModelConfig.from_dir(model_dir)
        if config.max_model_len is None:
            config.max_model_len = cfg.max_position_embeddings
        elif config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) is more than the model's "
                             f"max_position_embeddings ({cfg.max_position_embeddings})")
        weights = dummy_weights(cfg, config.seed) if config.load_format == "dummy" else load_safetensors(model_dir)
        self.max_model_len = config.max_model_len
        self.model = LlamaModel(cfg, weights, dtype, config.max_model_len)
        del weights
        self.model_config = cfg
        self.model_dir = model_dir
        self.vocab_size = cfg.vocab_size
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_id = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self.block_size = config.block_size
        bytes_per_block = 2 * cfg.num_layers * config.block_size * cfg.num_kv_heads * cfg.head_dim \
            * torch.tensor([], dtype=dtype).element_size()
        self.num_kv_blocks = config.num_kv_blocks or max(1, int(config.kv_cache_memory_gb * 2**30) // bytes_per_block)
        slots = self.num_kv_blocks * config.block_size
        # Zeros, not garbage: padded attention rows multiply masked slots by 0, and 0 * NaN is NaN.
        # numpy's zeros come from calloc, whose fresh pages the OS zeroes lazily: no 2 GiB memset
        # at start-up, and only the blocks in use ever take memory.
        shape = (cfg.num_layers, 2, slots, cfg.num_kv_heads, cfg.head_dim)
        cache = torch.from_numpy(np.zeros(shape, dtype=np.float32)).to(dtype)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
        self.sampler = Sampler(config.seed)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(out.finished_req_ids)
        batch = pack(out.chunks, self.block_size)
        logits = self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_caches,
                                    batch.logits_indices)
        result = ModelRunnerOutput()
        if batch.sampling_chunks:
            reqs = [c.request for c in batch.sampling_chunks]
            tokens, logprobs = self.sampler.sample(logits, reqs)
            result.sampled = {r.request_id: t for r, t in zip(reqs, tokens)}
            result.logprobs = logprobs
        return result
