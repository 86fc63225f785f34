"""Sizing the KV offload tiers of one engine core (`start_offload`): how many pages its host memory
and disk shares hold, under which fingerprint its ranks store them, and the manager that runs them
(`manager.OffloadManager`)."""

from __future__ import annotations

from pathlib import Path

from pagoda_engine.config import EngineConfig
from pagoda_engine.core.kv.block_pool import BlockPool
from pagoda_engine.core.kv.offload.manager import OffloadManager, kv_fingerprint
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.kv_tiers import HEADER_BYTES, OffloadSetup
from pagoda_engine.worker.executor import Executor, remote_store

_GiB = 1 << 30



def page_identity(config: EngineConfig, executor: Executor, model_dir: str) -> tuple[bytes, str]:
    """(fingerprint, description) of what makes another engine's or tier's KV pages this engine's:
    the weights, the page size and dtype, the layout and, for FP8 pages, every layer's scales (what
    a stored value means). The offload tiers and disaggregated prefill/decode's handshake key on it."""
    cc, mc, pc = config.cache, config.model, config.parallel
    spec = executor.kv_cache_spec(cc.block_size)
    specs = executor.kv_cache_specs(spec.page_size, spec.dtype)
    layout = (f"{executor.hf_config.num_hidden_layers} layers, {spec.num_kv_heads * pc.tensor_parallel_size} "
              f"kv heads x {spec.head_dim}, [page, 2, token, head, dim]")
    if spec.quantized:
        layout += f", k scales {[k for s in specs for k in s.k_scales]}, v scales {[v for s in specs for v in s.v_scales]}"
    description = f"{layout}, page {cc.block_size}, KV {spec.dtype}"
    return kv_fingerprint(model_dir, mc.load_format, mc.seed, str(spec.dtype), cc.block_size, layout,
                          mc.quantization), description

def start_offload(config: EngineConfig, executor: Executor, pool: BlockPool, model_dir: str) -> OffloadManager:
    """The KV tiers below the device pool, on every rank. The sizes are the pod's: with
    data-parallel engine cores each core of the pod (of its node, with cores on several nodes)
    takes its share, and its own disk directory."""
    cc, pc = config.cache, config.parallel
    spec = executor.kv_cache_spec(cc.block_size)
    specs = executor.kv_cache_specs(spec.page_size, spec.dtype)
    page_bytes = sum(s.bytes_per_page() for s in specs)
    share = 1 / (pc.data_parallel_size_local or pc.data_parallel_size)
    disk_path = cc.kv_offload_disk_path
    if disk_path is not None and pc.data_parallel_size > 1:
        disk_path = str(Path(disk_path) / f"core-{pc.data_parallel_rank}")
    fingerprint, _ = page_identity(config, executor, model_dir)
    setup = OffloadSetup(fingerprint,
                         num_cpu_slots=int(cc.kv_offload_cpu_gb * share * _GiB) // page_bytes,
                         disk_path=disk_path, remote_url=cc.kv_offload_remote_url)
    if cc.kv_offload_cpu_gb > 0 and setup.num_cpu_slots == 0:
        raise ModelLoadError(f"--kv-offload-cpu-gb {cc.kv_offload_cpu_gb} holds no page ({page_bytes} bytes each)")
    disk_pages = int(cc.kv_offload_disk_gb * share * _GiB) // (page_bytes + HEADER_BYTES * len(specs))
    if cc.kv_offload_disk_path is not None and disk_pages == 0:
        raise ModelLoadError(f"--kv-offload-disk-gb {cc.kv_offload_disk_gb} holds no page ({page_bytes} bytes each)")
    return OffloadManager(pool, cc.block_size, executor, setup, disk_pages, page_bytes,
                          split_loads=cc.kv_offload_split_loads, open_remote=remote_store)
