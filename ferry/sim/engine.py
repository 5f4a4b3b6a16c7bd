"""Engines on the simulated executor, sized as a real engine would be on that hardware."""
from __future__ import annotations

from dataclasses import replace

from ferry.config import EngineConfig
from ferry.core.clock import ManualClock
from ferry.engine.llm_engine import LLMEngine
from ferry.executor.simulated import SimulatedExecutor
from ferry.model.config import ModelConfig
from ferry.sim.cost_model import CostModel
from ferry.sim.hardware import Hardware


class SimEngineFactory:
    """Same ``engine(config)`` as the bench's EngineFactory; each engine gets its own clock at 0."""

    def __init__(self, model: ModelConfig, hw: Hardware, tp: int = 1, gpu_memory_utilization: float = 0.9,
                 spec_acceptance_rate: float = 0.5) -> None:
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if not 0 <= spec_acceptance_rate <= 1:
            raise ValueError(f"spec_acceptance_rate must be in [0, 1], got {spec_acceptance_rate}")
        self.spec_acceptance_rate = spec_acceptance_rate
        self.cost = CostModel(model, hw, tp)
        self.model, self.hw, self.tp = model, hw, tp
        self.gpu_memory_utilization = gpu_memory_utilization

    def num_kv_blocks(self, config: EngineConfig) -> int:
        """Blocks that fit: a fixed KV size if the profile has one (a CPU engine), otherwise device
        memory x utilisation x tp minus the weights, as a GPU engine sizes its cache."""
        if config.num_kv_blocks:
            return config.num_kv_blocks
        per_block = self.cost.kv_bytes_per_token * config.block_size
        if self.hw.kv_cache_memory_gb is not None:
            return max(1, int(self.hw.kv_cache_memory_gb * 2**30) // per_block)
        free = self.hw.memory_gb * 1e9 * self.gpu_memory_utilization * self.tp - self.cost.weight_bytes_total
        if free < per_block:
            raise ValueError(f"the weights ({self.cost.weight_bytes_total / 1e9:.1f} GB) leave no room for a KV "
                             f"cache on {self.tp} x {self.hw.name} ({self.hw.memory_gb:g} GB at "
                             f"gpu_memory_utilization {self.gpu_memory_utilization}); raise tensor_parallel_size")
        return int(free // per_block)

    def engine(self, config: EngineConfig) -> LLMEngine:
        if config.max_model_len is None:
            config = replace(config, max_model_len=self.model.max_position_embeddings)
        elif config.max_model_len > self.model.max_position_embeddings:
            raise ValueError(f"max_model_len ({config.max_model_len}) is more than the model's "
                             f"max_position_embeddings ({self.model.max_position_embeddings})")
        clock = ManualClock()
        return LLMEngine(config, SimulatedExecutor(self.cost, clock, self.spec_acceptance_rate), self.num_kv_blocks(config), clock=clock)
