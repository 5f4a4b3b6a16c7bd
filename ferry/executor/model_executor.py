"""The model executor: load the model, hold the KV cache, run one packed step, sample."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ferry.config import EngineConfig
from ferry.core.outputs import ModelRunnerOutput, SchedulerOutput
from ferry.core.sampling_params import SamplingParams
from ferry.executor.base import Executor, StepTimer, no_tick
from ferry.executor.batch import PackedBatch, pack
from ferry.executor.draft import DraftModel
from ferry.executor.kv_tensors import allocate, block_bytes, kv_groups
from ferry.executor.images import ImageSteps
from ferry.executor.request_state import RequestStates
from ferry.executor.pooling import pool
from ferry.executor.sampler import Sampler, prompt_logprobs
from ferry.executor.structured import GrammarCompiler
from ferry.model.arch import ARCHITECTURES
from ferry.model.config import ModelConfig, generation_eos_ids
from ferry.model.device import default_dtype, kv_blocks_for_memory, lazy_zeros, release_freed_memory, resolve_device
from ferry.model.kv_format import cache_dtype
from ferry.model.decoder import DecoderModel, ForwardOutput
from ferry.model.multimodal import ImageEncoder
from ferry.model.tensor_parallel import Collectives, ShardPlan
from ferry.model.loader import DTYPES, load_mmproj, load_weights, resolve_model_dir
from ferry.model.quant import uses_q8
from ferry.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def resolve_max_model_len(cfg: ModelConfig, asked: int | None) -> int:
    """The context length to serve: ``asked``, or the model's own, within what ferry computes exactly."""
    limit, why = cfg.max_position_embeddings, "the model's max_position_embeddings"
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"max_model_len ({asked}) is more than {why} ({limit})")
    return asked


def state_slots(config: EngineConfig, state_bytes: int) -> int:
    """Recurrent-state slots to hold: ``num_state_slots``, or one per sequence and as many again for
    the prefix cache's snapshots, within half the memory budget."""
    if config.num_state_slots:
        return config.num_state_slots
    fit = int(config.kv_cache_memory_gb * 2**30 / 2 // state_bytes)
    return max(1, min(2 * config.max_num_seqs, fit))


def copy_states(caches: list[dict[str, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copy each (source, destination) slot's state, every recurrent layer's."""
    if not pairs or not caches:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    for layer in caches:
        for t in layer.values():
            t.index_copy_(0, dst.to(t.device), t.index_select(0, src.to(t.device)))


def _refuse_mtp(cfg: ModelConfig, model: str | None = None) -> None:
    """speculative_config.method 'mtp' for a model without an MTP head ferry reads: say so."""
    from ferry.executor.gemma4_assistant import assistant_config
    from ferry.executor.mtp import MTP_ARCHITECTURES

    if cfg.architecture not in MTP_ARCHITECTURES and assistant_config(model) is None:
        raise ValueError(f"speculative_config.method 'mtp': {cfg.architecture} has no MTP head ferry reads "
                         f"(it reads those of {', '.join(sorted(MTP_ARCHITECTURES))})")


def _load_mtp(config: EngineConfig, setup: "ModelSetup", target: DecoderModel, kv_dtype: torch.dtype) -> Any:
    """The MTP drafter: the head from the checkpoint's mtp.* tensors, or from llama.cpp's MTP GGUF
    named by ``speculative_config.model``."""
    from ferry.executor.gemma4_assistant import Gemma4AssistantHead, Gemma4AssistantProposer, assistant_config
    from ferry.executor.mtp import MTPHead, MTPProposer

    spec = config.speculative_config
    assert spec is not None
    if assistant_config(spec.model) is not None:  # Gemma 4's assistant: reads the target's K/V (attach)
        assistant = Gemma4AssistantHead.load(spec.model, setup.model_config, target, DTYPES[setup.dtype_name],
                                             setup.max_model_len, setup.device)
        target.keep_hidden = True
        return Gemma4AssistantProposer(assistant, spec.num_speculative_tokens, config.block_size, config.seed)
    head = MTPHead.load(setup.model_dir, setup.model_config, target, DTYPES[setup.dtype_name], setup.max_model_len,
                        setup.device, gguf=spec.model)
    target.keep_hidden = True  # the head reads every row's hidden state
    return MTPProposer(head, spec.num_speculative_tokens, config.block_size, kv_dtype, config.seed)


@dataclass
class ModelSetup:
    """Everything known about a model before its weights load: the settings resolved for the device,
    the model's shape and length, its tokenizer and end-of-sequence ids. The tensor-parallel driver
    needs these without loading weights."""

    config: EngineConfig  # quantization and dtype resolved
    device: torch.device
    dtype_name: str
    model_dir: Path
    model_config: ModelConfig
    max_model_len: int
    tokenizer: Any
    eos_token_ids: tuple[int, ...]

    @classmethod
    def resolve(cls, config: EngineConfig) -> "ModelSetup":
        device = resolve_device(config.device)
        dtype_name = default_dtype(device) if config.dtype == "auto" else config.dtype
        if device.type == "cuda":
            if config.quantization == "gguf":
                raise ValueError("quantization 'gguf' runs on the CPU's kernels; on CUDA use quantization "
                                 "'none' (a GGUF is dequantized at load)")
            config = replace(config, quantization="none")
        config = replace(config, dtype=dtype_name)  # what the loader reads
        dtype = DTYPES[dtype_name]
        if dtype is not torch.float32:
            try:
                torch.ones(2, 2, dtype=dtype, device=device) @ torch.ones(2, 2, dtype=dtype, device=device)
            except RuntimeError as e:
                raise ValueError(f"dtype {dtype_name!r} is not supported on {device}: {e}") from None
        model_dir = resolve_model_dir(config.model, config.cache_dir, floats=False)
        cfg = ModelConfig.from_dir(model_dir)
        tokenizer = load_tokenizer(model_dir)
        # Every end-of-sequence id stops a request: the tokenizer's, config.json's and
        # generation_config.json's (Llama 3 lists several); the tokenizer's comes first.
        eos = [tokenizer.eos_token_id] if tokenizer is not None else []
        eos_ids = tuple(dict.fromkeys(t for t in eos + cfg.eos_token_ids + generation_eos_ids(model_dir)
                                      if t is not None))
        return cls(config, device, dtype_name, model_dir, cfg, resolve_max_model_len(cfg, config.max_model_len),
                   tokenizer, eos_ids)


class ModelExecutor(Executor):
    """Runs the real model. Resolves the model length (``max_model_len``) and sizes the KV cache.

    With ``rank`` and ``collectives`` (a function of the rank's ShardPlan and the vocabulary size
    that returns its Collectives) it is one tensor-parallel rank (``ferry.executor.tensor_parallel``
    starts them): it holds that rank's shard of the weights and of the KV cache.
    """

    def __init__(self, config: EngineConfig, rank: int = 0,
                 collectives: Callable[[ShardPlan, int], Collectives] | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        setup = ModelSetup.resolve(config)
        config, cfg = setup.config, setup.model_config
        if config.speculative_config is not None and config.speculative_config.method == "mtp":
            _refuse_mtp(cfg, config.speculative_config.model)
        self.device, self.dtype_name = setup.device, setup.dtype_name
        dtype = DTYPES[self.dtype_name]
        self.max_model_len = setup.max_model_len
        world = config.tensor_parallel_size if collectives is not None else 1
        plan = ShardPlan.make(cfg, rank, world)
        comm = collectives(plan, cfg.vocab_size) if collectives is not None else None
        weights = load_weights(config, cfg, setup.model_dir)
        q8 = uses_q8(weights)
        self.model = DecoderModel(cfg, weights, dtype, self.max_model_len, self.device, plan, comm)
        # An image model's vision tower, its encoder cache and rope positions (None: a text model).
        # A GGUF's tower (llama.cpp's mmproj file), and the image model the pair forms.
        mmproj, image_arch = load_mmproj(config, cfg.architecture)
        encoder = ImageEncoder.load(setup.model_dir, image_arch, dtype, self.device, mmproj)
        self.images = ImageSteps(encoder, ARCHITECTURES[image_arch].bidirectional_images) \
            if encoder is not None else None
        del weights
        release_freed_memory()
        self.model_config = cfg
        self.model_dir = setup.model_dir
        self.vocab_size = cfg.vocab_size
        self.tokenizer = setup.tokenizer
        self.eos_token_ids = setup.eos_token_ids
        if encoder is not None and self.tokenizer is not None:
            from ferry.multimodal.processor import ImagePrompter  # transformers' image processors

            self.image_prompter = ImagePrompter.for_model(setup.model_dir, self.tokenizer, mmproj=mmproj,
                                                          architecture=image_arch)
        self.block_size = config.block_size
        kv_dtype = cache_dtype(config.kv_cache_dtype, dtype, q8)
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        # Every rank has the same number of blocks (one scheduler, one block table), sized for the
        # rank holding the most KV heads. Only attention layers keep K/V, by their cache's shape.
        groups = kv_groups(cfg)
        bytes_per_block = block_bytes(groups, config.block_size, kv_dtype, plan.max_kv_heads if world > 1 else None)
        # A draft model's KV layers live in the same blocks: each block costs both models' bytes.
        self.draft = DraftModel(config, cfg, self.tokenizer, self.max_model_len, self.device, config.seed) \
            if config.draft_model is not None else None
        self.draft_dists: dict[str, torch.Tensor] = {}
        if self.draft is not None:
            bytes_per_block += self.draft.bytes_per_block(config.block_size)
        # An MTP head (method "mtp"): its attention layer's KV in the same blocks, like a draft model's.
        self.mtp = _load_mtp(config, setup, self.model, kv_dtype) \
            if config.speculative_config is not None and config.speculative_config.method == "mtp" else None
        if self.mtp is not None:
            bytes_per_block += self.mtp.bytes_per_block(config.block_size)
        # A hybrid model's states before a verify step (slots, copies, request -> (slot, k)).
        self._verify_states: tuple[torch.Tensor, list[dict[str, torch.Tensor]], dict[str, tuple[int, int]]] | None \
            = None
        self._step_chunks: list[Any] = []
        state_bytes = 4 * cfg.state_floats  # one request's recurrent state, every recurrent layer's
        self.num_state_slots = state_slots(config, state_bytes) if state_bytes else 0
        budget = config.kv_cache_memory_gb * 2**30 - self.num_state_slots * state_bytes
        if config.num_kv_blocks:
            self.num_kv_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # The largest step's activations: a few hidden-sized and MLP-sized rows per token,
            # and float32 logits for every row that samples (upper bound: every token).
            T = config.max_num_batched_tokens
            act = T * (6 * cfg.hidden_size + 4 * cfg.intermediate_size) * elem + T * cfg.vocab_size * 4 * 2
            self.num_kv_blocks = kv_blocks_for_memory(total, free, config.gpu_memory_utilization,
                                                      bytes_per_block, act)
            if comm is not None:  # the rank with the least memory sets the count for all
                self.num_kv_blocks = comm.agree_min(self.num_kv_blocks)
        else:
            if budget < bytes_per_block:
                raise ValueError(f"kv_cache_memory_gb ({config.kv_cache_memory_gb}) leaves no room for KV blocks "
                                 f"after {self.num_state_slots} recurrent states of {state_bytes / 2**20:.1f} MiB: "
                                 "raise it or lower num_state_slots")
            self.num_kv_blocks = max(1, int(budget) // bytes_per_block)
        slots = self.num_kv_blocks * config.block_size
        # Zeros, not garbage: padded attention rows multiply masked slots by 0, and 0 * NaN is NaN.
        # On the CPU the OS zeroes fresh pages lazily: no 2 GiB memset at start-up, and only the
        # blocks in use ever take memory.
        zeros = lazy_zeros if self.device.type == "cpu" else \
            (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=self.device))
        # Per layer: (K, V) of an attention layer, the state tensors of a recurrent one.
        self.kv_caches: list[Any] = allocate(cfg.num_layers, groups, slots, kv_dtype, zeros,
                                             plan.num_kv_heads if world > 1 else None)
        for i in cfg.attention_layers:  # a layer sharing another's K/V (Gemma 4) holds that layer's cache
            if cfg.layers[i].attention.kv_source is not None:
                self.kv_caches[i] = self.kv_caches[cfg.layers[i].attention.kv_source]
        for i in cfg.recurrent_layers:
            self.kv_caches[i] = {name: zeros((self.num_state_slots, *shape), torch.float32)
                                 for name, shape in cfg.state_shapes(i).items()}
        self.state_caches = [self.kv_caches[i] for i in cfg.recurrent_layers]
        if self.draft is not None:
            self.draft.allocate(self.num_kv_blocks, zeros)
        if self.mtp is not None:
            self.mtp.allocate(self.num_kv_blocks, zeros)
            if hasattr(self.mtp, "attach"):  # Gemma 4's assistant reads the target's K/V
                self.mtp.attach(self.kv_caches)
        # Builds nothing until a request asks for structured outputs.
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                        max_compile_seconds=config.max_grammar_compile_seconds)
        self.sampler = Sampler(config.seed, grammars=self.grammars, device=self.device)
        self.states = RequestStates()
        self.tick: Callable[[str], None] = no_tick
        self.matmul_precision = config.fp32_matmul_precision

    @property
    def whole_images(self) -> bool:
        """The image model's rule (a GGUF + mmproj pair's too, whose text architecture has none)."""
        return self.images is not None and self.images.bidirectional

    def check_sampling_params(self, sp: SamplingParams) -> Any:
        """Raise ValueError (naming the field) if ``sp`` cannot be served; compiles its grammar
        and returns it (for ``hold_grammar``), or None."""
        return None if sp.structured_outputs is None else self.grammars.validate(sp.structured_outputs)

    def hold_grammar(self, request_id: str, compiled: Any) -> None:
        """Keep a queued request's compiled grammar until it ends (the cache may drop it meanwhile)."""
        self.grammars.hold(request_id, compiled)

    def set_profiler(self, profiler: StepTimer | None) -> None:
        """Report the parts of each step to ``profiler`` (``LLMEngine.attach_profiler``)."""
        self.tick = no_tick if profiler is None else profiler.tick
        self.model.profiler = profiler

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if not out.chunks:
            return self.encode_only(out)
        batch = self.prepare(out)
        return self.sample(batch, self.forward(batch))

    def encode_only(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """A step of encoder work alone (an image encoded across steps, no token ready to run):
        its bookkeeping and its share of each image's encoding."""
        self._take_in(out)
        for proposer in (self.draft, self.mtp):
            if proposer is not None:
                proposer.forget(out)
        result = ModelRunnerOutput()
        if self.images is not None:
            result.encoder_seconds = self.images.take_seconds()
        return result

    def _take_in(self, out: SchedulerOutput) -> None:
        """The step's bookkeeping, then its encoder work (before anything else moves: a request
        whose image fails to encode fails alone, ``RequestFailed``)."""
        # Process-wide in torch: set for every step, as another engine in this process may differ.
        torch.backends.mkldnn.matmul.fp32_precision = self.matmul_precision
        self.sampler.forget(out.finished_req_ids)
        self.states.apply(out)
        if self.images is not None:
            self.images.apply(out)
            self.tick("encoder")

    # The three parts of a step (a tensor-parallel rank tells a failure of the first, which leaves
    # the ranks in step, from one inside the forward pass's collectives, which does not).
    def prepare(self, out: SchedulerOutput) -> PackedBatch:
        """Take in the step's bookkeeping and encoder work, and pack its tokens."""
        self._take_in(out)
        if self.draft is not None:  # fills the verify chunks' drafts before they are packed
            self.draft_dists = self.draft.propose(out, self.states)
            self.tick("draft")
        if self.mtp is not None:  # the same, from the MTP head and the target's last hidden states
            self.draft_dists = self.mtp.propose(out, self.states)
            self._step_chunks = out.chunks
            self._keep_verify_states(out.chunks)
            self.tick("draft")
        batch = pack(out.chunks, self.states, self.block_size, out.state_copies)
        images = None
        if self.images is not None:  # the image rows and positions of the batch
            images = self.images.to(self.images.rows(out, batch, self.states), self.device)
        batch = batch.to(self.device)
        batch.images = images
        self.tick("pack")
        return batch

    def forward(self, batch: PackedBatch) -> ForwardOutput:
        copy_states(self.state_caches, batch.state_copies)  # requests resuming from a prefix-cache snapshot
        out = self.model.forward(batch.input_ids, batch.positions, batch.meta, self.kv_caches,
                                 batch.logits_indices, batch.prompt_indices, batch.pool_indices, batch.images)
        copy_states(self.state_caches, batch.snapshots)  # states kept for the prefix cache
        return out

    def sample(self, batch: PackedBatch, out: ForwardOutput) -> ModelRunnerOutput:
        """Sample (and score prompt tokens, pool embeddings) from the forward pass; record the new tokens."""
        result = ModelRunnerOutput()
        if batch.sampling:
            result.sampled, result.logprobs = self.sampler.sample(out.logits, batch.sampling, self.draft_dists)
        if batch.prompt_spans:
            project = None if out.prompt_projected else self.model.project
            result.prompt_logprobs = prompt_logprobs(out.prompt_rows, batch.prompt_spans, project)
        if batch.pool_spans:
            result.pooled = pool(out.pool_rows, batch.pool_spans)
        self.states.append_tokens(result.sampled)
        if self.images is not None:
            result.encoder_seconds = self.images.take_seconds()
        if self.mtp is not None:
            self._rewind_rejected(result.sampled)
            if out.all_hidden is not None:
                self.mtp.observe(self._step_chunks, out.all_hidden, result.sampled)
        self.tick("sample")
        return result

    def _keep_verify_states(self, chunks: list[Any]) -> None:
        """A hybrid model's verify chunks: their requests' recurrent states as they are before the
        step, put back where a draft is rejected (the scheduler then runs the verify's tokens again)."""
        self._verify_states = None
        verifying = {c.request_id: (c.state_slot, len(c.spec_token_ids)) for c in chunks
                     if c.spec_token_ids and c.state_slot >= 0}
        if not verifying or not self.state_caches:
            return
        slots = torch.tensor([s for s, _ in verifying.values()], dtype=torch.long)
        saved = [{n: t.index_select(0, slots.to(t.device)) for n, t in layer.items()} for layer in self.state_caches]
        self._verify_states = (slots, saved, verifying)

    def _rewind_rejected(self, sampled: dict[str, list[int]]) -> None:
        if self._verify_states is None:
            return
        slots, saved, verifying = self._verify_states
        self._verify_states = None
        back = [i for i, (rid, (_, k)) in enumerate(verifying.items()) if len(sampled.get(rid, ())) - 1 < k]
        if not back:
            return
        idx = torch.tensor(back, dtype=torch.long)
        for layer, kept in zip(self.state_caches, saved):
            for n, t in layer.items():
                t.index_copy_(0, slots[idx].to(t.device), kept[n].index_select(0, idx.to(t.device)))
