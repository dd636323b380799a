"""The engine's load as `kmesh serve --engine vllm` reports it, from vLLM's stat-logger hook.

vLLM calls every stat logger after each engine step with the scheduler's stats (running and
waiting requests, KV cache usage) and the step's iteration stats (prompt tokens computed,
tokens generated). `load_logger(publish)` is a factory for AsyncLLM's `stat_loggers`: its
logger hands `publish` an EngineLoad after each step, computed tokens summed since the start.
Imports vLLM (only where vLLM runs).
"""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase

from kmesh.stats import EngineLoad

Publish = Callable[[EngineLoad], None]


def load_logger(publish: Publish) -> Callable[[VllmConfig, int], StatLoggerBase]:
    def factory(vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        return _LoadLogger(publish)

    return factory


class _LoadLogger(StatLoggerBase):
    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self._computed = 0
        self._load = EngineLoad(running=0, waiting=0, kv_usage=0.0, computed_tokens=0)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:
            self._computed += iteration_stats.prompt_token_stats.computed
            self._computed += iteration_stats.num_generation_tokens
        if scheduler_stats is None:
            self._load = replace(self._load, computed_tokens=self._computed)
        else:
            self._load = EngineLoad(
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs,
                kv_usage=scheduler_stats.kv_cache_usage,
                computed_tokens=self._computed,
            )
        self._publish(self._load)

    def log_engine_initialized(self) -> None:
        pass
