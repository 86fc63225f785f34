"""`pagoda bench kv-transfer`: disaggregated prefill/decode's page transfer (issue 51's target "KV
transfer >= 50 % of the measured GPU-to-GPU copy bandwidth for a 4,096-token prompt").

Two engine cores in this process, built from the same engine flags (by default Llama-3.1-8B's
architecture with dummy bf16 weights), one a `kv_producer` and one a `kv_consumer`, both on the one
device (each with its KV pool fixed by `--num-gpu-blocks-override`, default: three prompts' pages),
talking through the real endpoint, handshake and gloo pair on 127.0.0.1, as two pods would. Each of
`--num-prompts` rounds takes a fresh random prompt of `--input-len` tokens (4,096): the producer
runs it (`max_tokens` 1, `do_remote_decode`), then the consumer is given the returned params and
pulls the pages (`--kv-connector`: NIXL, where its wheel is installed, or the torch connector's
gloo pair); one untimed round first. Per round: the pull's wall time (handshake, gloo group,
gather, send, receive, scatter; `pagoda:kv_transfer_seconds`), the bytes, whether the consumer's
first token equals the producer's, and the consumer's time to first token against recomputing a
fresh prompt of the same length on the same consumer.

Printed (and `--output-json`): pages/s and GB/s of the pulls (median round), the device's own
copy bandwidth for comparison (one device-to-device copy of 1 GiB: bytes copied per second) and
the pulls' share of it, host<->device pinned copy bandwidths (gloo moves host memory, so with the
torch connector on a GPU the pages go device -> host -> host -> device; NIXL reads device memory
where UCX can), TTFT with a pull and recomputing, and the first-token
agreement. On CPU it runs the same way (tiny model sizes via `--model pagoda-tiny`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pagoda_engine.config import EngineConfig
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.sampling_params import SamplingParams


def add_kv_transfer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-connector", default=None, choices=["NixlConnector", "PagodaTorchConnector"],
                   help="the transfer measured (default: NIXL where it is installed, else the torch connector)")
    p.set_defaults(input_len=4096, num_prompts=5)


def _run(core, rid: str, prompt: list[int], params: dict | None) -> tuple[list[int], dict | None, float]:
    """One request to its end; its tokens, its answer's kv_transfer_params and its time to first token."""
    t0 = time.perf_counter()
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, kv_transfer_params=params)))
    tokens, answer, ttft = [], None, None
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += list(out.new_token_ids)
            answer = out.kv_transfer_params or answer
            if ttft is None and len(out.new_token_ids):
                ttft = time.perf_counter() - t0
    return tokens, answer, ttft


def run_kv_transfer(args: argparse.Namespace, config: EngineConfig) -> dict:
    import dataclasses

    import torch

    from pagoda_engine.bench.multiturn import measure_pinned_bandwidth
    from pagoda_engine.bench.offline import measure_copy_bandwidth
    from pagoda_engine.core.engine_core import EngineCore
    from pagoda_engine.kv_transfer import parse_kv_transfer_config

    n, rounds = args.input_len, args.num_prompts
    cc = config.cache
    pages = -(-(n + 16) // cc.block_size)
    cache = dataclasses.replace(cc, num_gpu_blocks_override=cc.num_gpu_blocks_override or 3 * pages + 1)
    model = dataclasses.replace(config.model, max_model_len=config.model.max_model_len or n + 16)
    cores = []
    for role in ("kv_producer", "kv_consumer"):
        transfer = parse_kv_transfer_config({"kv_role": role, "kv_port": 0, "kv_connector": args.kv_connector,
                                             "kv_connector_extra_config": {"transfer_timeout_s": 120}})
        cores.append(EngineCore(dataclasses.replace(config, cache=cache, model=model, kv_transfer_config=transfer)))
    producer, consumer = cores
    rng = np.random.default_rng(0)
    vocab = producer.vocab_size
    rows = []
    try:
        for i in range(rounds + 1):
            prompt = rng.integers(10, vocab - 1, n).tolist()
            expected, params, _ = _run(producer, f"p{i}", prompt, {"do_remote_decode": True})
            before = (consumer.kv_transfer.counters.seconds, consumer.kv_transfer.counters.bytes_received)
            got, _, ttft_pull = _run(consumer, f"c{i}", prompt, params)
            seconds = consumer.kv_transfer.counters.seconds - before[0]
            nbytes = consumer.kv_transfer.counters.bytes_received - before[1]
            _, _, ttft_recompute = _run(consumer, f"r{i}", rng.integers(10, vocab - 1, n).tolist(), None)
            if i == 0:
                continue  # untimed: connections, kernels, allocator
            rows.append({"pages": len(params["remote_block_ids"]), "bytes": nbytes, "seconds": seconds,
                         "first_token_match": got == expected, "ttft_pull_s": ttft_pull,
                         "ttft_recompute_s": ttft_recompute})
        failures = consumer.kv_transfer.counters.failures
        connector = consumer.kv_transfer.connector
    finally:
        for core in cores:
            core.close()
    median = sorted(rows, key=lambda r: r["seconds"])[len(rows) // 2]
    device = torch.device(config.model.device if config.model.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    copy = measure_copy_bandwidth(device) if device.type == "cuda" else None
    copy = copy / 2 if copy else None  # bytes copied per second (the helper counts read + write)
    gbps = median["bytes"] / median["seconds"] / 1e9 if median["seconds"] else None
    result = {
        "bench": "kv-transfer", "input_len": n, "rounds": rounds, "block_size": cc.block_size,
        "pages_per_pull": median["pages"], "bytes_per_pull": median["bytes"],
        "pull_ms_median": median["seconds"] * 1e3, "pages_per_s": median["pages"] / median["seconds"],
        "transfer_GBps": gbps, "device_copy_GBps": copy / 1e9 if copy else None,
        "share_of_device_copy": gbps * 1e9 / copy if copy and gbps else None,
        "pinned_h2d_GBps": (measure_pinned_bandwidth() or 0) / 1e9 or None,
        "pinned_d2h_GBps": (measure_pinned_bandwidth(to_device=False) or 0) / 1e9 or None,
        "ttft_pull_ms_median": statistics.median(r["ttft_pull_s"] for r in rows) * 1e3,
        "ttft_recompute_ms_median": statistics.median(r["ttft_recompute_s"] for r in rows) * 1e3,
        "first_token_match": sum(r["first_token_match"] for r in rows), "failures": failures,
        "connector": connector, "device": str(device), "rows": rows,
    }
    result["valid"] = failures == 0 and all(r["pages"] > 0 and r["bytes"] > 0 for r in rows)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    return result
