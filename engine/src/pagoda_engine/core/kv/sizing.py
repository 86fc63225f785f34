"""How many KV pages one engine core's pool has (`num_kv_pages`): the count the config fixes, or
what every rank's memory holds (`Executor.determine_num_kv_pages`), at most what max_num_seqs
sequences of max_model_len can use."""

from __future__ import annotations

from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.worker.executor import Executor


def num_kv_pages(config: EngineConfig, executor: Executor, max_model_len: int) -> int:
    """Pages of the pool, the null page included; ModelLoadError where they hold less than one
    sequence of max_model_len."""
    cc, sc = config.cache, config.scheduler
    pages_per_seq = -(-max_model_len // cc.block_size)
    if cc.num_gpu_blocks_override is not None:
        if cc.num_gpu_blocks_override < pages_per_seq + 1:
            raise ModelLoadError(f"--num-gpu-blocks-override {cc.num_gpu_blocks_override} holds fewer pages than one "
                                 f"sequence of max_model_len {max_model_len} needs ({pages_per_seq} + the null "
                                 "page); raise it or lower --max-model-len")
        return cc.num_gpu_blocks_override
    if cc.num_kv_pages:
        return cc.num_kv_pages
    useful = sc.max_num_seqs * pages_per_seq + 1  # more than this can never be used
    num_pages = min(executor.determine_num_kv_pages(config, max_model_len), useful)
    if num_pages < pages_per_seq + 1:
        raise ModelLoadError(
            f"the KV pool fits {max(num_pages - 1, 0)} pages ({max(num_pages - 1, 0) * cc.block_size} tokens), "
            f"fewer than one sequence of max_model_len {max_model_len} needs ({pages_per_seq} pages); "
            "lower --max-model-len or raise --gpu-memory-utilization")
    return int(num_pages)
