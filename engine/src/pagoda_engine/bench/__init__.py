"""`pagoda bench throughput | latency | serve | multiturn | kv-share`: the workloads of docs/benchmarks.md.

    pagoda bench throughput --workload T1     # 1000 x 1024 in x 512 out: output and total tok/s
    pagoda bench throughput --workload N1     # 256 requests, lengths uniform in [100, 1024]
    pagoda bench latency                      # L1: one stream, 128 in, 512 out: ms per output token
    pagoda bench serve                        # S1: the OpenAI server under Poisson load: TTFT, ITL
    pagoda bench multiturn --kv-offload-cpu-gb 64   # M1: multi-turn contexts beyond the KV pool
    pagoda bench kv-share                     # two engines sharing Redis: TTFT of a remote hit vs recompute
    pagoda bench kv-transfer                  # disaggregated prefill/decode: pages/s and GB/s of a 4,096-token pull

By default the model is Llama-3.1-8B's architecture (the config.json shipped under
`bench/configs/llama-3.1-8b`; `--model qwen3-30b-a3b` takes the MoE one shipped beside it, `--model
llama-api-cpu` a tiny Llama that lets `bench serve` measure the API process on a CPU) with
`--load-format dummy` random bf16 weights (a drafting model's too: `--speculative-config '{"method":
"draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 4}'` times the drafting path); every engine flag of
`pagoda serve` applies; `--async-scheduling` is on by default on CUDA. Each run prints its figures with the roofline (weight bytes ÷ a measured
device copy bandwidth), the settings, the GPU and the versions, and can write them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path

from pagoda_engine.bench.lora import add_lora_arguments, apply_lora_arguments
from pagoda_engine.bench.epp_decision import add_epp_decision_arguments
from pagoda_engine.bench.kv_share import add_kv_share_arguments
from pagoda_engine.bench.kv_transfer import add_kv_transfer_arguments
from pagoda_engine.bench.prefix_routing import add_prefix_routing_arguments
from pagoda_engine.bench.multiturn import add_multiturn_arguments
from pagoda_engine.bench.serve import add_serve_arguments
from pagoda_engine.bench.workloads import WORKLOADS
from pagoda_engine.config import add_engine_args, config_from_args

DEFAULT_MODEL = "llama-3.1-8b"


def shipped_config_dir(name: str = DEFAULT_MODEL) -> str:
    """The directory of a config.json shipped with the benchmarks (llama-3.1-8b, qwen3-30b-a3b,
    llama-api-cpu)."""
    return str(resources.files("pagoda_engine").joinpath(f"bench/configs/{name}"))


def default_model_dir() -> str:
    return shipped_config_dir(DEFAULT_MODEL)


def _shipped_or_given(name: str) -> str:
    shipped = Path(shipped_config_dir(name)) if "/" not in name else None
    if shipped is not None and (shipped / "config.json").is_file() and not Path(name).exists():
        return str(shipped)
    return name


def _resolve_model(args: argparse.Namespace) -> None:
    """`--model qwen3-30b-a3b` names a shipped config; anything else is a directory. So does a
    drafting model's `model` in `--speculative-config` (`llama-3.2-1b`, `eagle3-llama-3.1-8b`:
    dummy weights of those shapes, to time the drafting path)."""
    args.model = _shipped_or_given(args.model)
    spec = getattr(args, "speculative_config", None)
    if isinstance(spec, str):
        try:
            given = json.loads(spec)
        except ValueError:
            return  # refused with its reason by the config's check
        if isinstance(given, dict) and isinstance(given.get("model"), str):
            given["model"] = _shipped_or_given(given["model"])
            args.speculative_config = json.dumps(given)


def _add_engine_and_sizes(p: argparse.ArgumentParser, offline: bool = True) -> None:
    add_engine_args(p)
    p.set_defaults(model=default_model_dir(), load_format="dummy", dtype="bfloat16")
    if offline:
        # vLLM's offline defaults on 80+ GB GPUs are 1,024 sequences and 16,384 tokens per step; 512
        # sequences is what the KV pool of an H200 holds for T1 (1,536 tokens each) without
        # preemption. `bench serve` keeps `pagoda serve`'s own defaults: what users run.
        p.set_defaults(max_num_seqs=512, max_num_batched_tokens=16384)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="override the workload's request count (smoke runs; the result is then not T1/N1/L1)")
    p.add_argument("--input-len", type=int, default=None, help="override the workload's input length (smoke runs)")
    p.add_argument("--output-len", type=int, default=None, help="override the workload's output length (smoke runs)")
    p.add_argument("--output-json", default=None, help="also write the results as JSON to this file")


def _add_common(p: argparse.ArgumentParser) -> None:
    _add_engine_and_sizes(p)
    add_lora_arguments(p)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="record a torch.profiler trace of a few steps into DIR and print the top kernels")
    p.add_argument("--profile-steps", default=None, metavar="FIRST:COUNT", type=_step_range,
                   help="which steps --profile records (default 300:10 for throughput, 100:20 for latency)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    t = sub.add_parser("throughput", help="offline throughput: T1 (default) or N1")
    _add_common(t)
    t.add_argument("--workload", default="T1", choices=[w for w in WORKLOADS if w != "L1"])
    lat = sub.add_parser("latency", help="single-stream latency: L1")
    _add_common(lat)
    lat.add_argument("--workload", default="L1", choices=["L1"])
    lat.add_argument("--num-iters", type=int, default=3, help="timed repetitions (after one warm-up)")
    lat.add_argument("--spec-replay-acceptance", default=None, metavar="SHARES",
                     help="benchmark speculative decoding's verification: replay the target's own greedy "
                          "continuation as drafts, each drafted token corrupted with probability 1 - share "
                          "(comma-separated shares in [0, 1], e.g. 0,0.5,0.8,1); greedy runs, against a greedy "
                          "run without speculation (a benchmark tool: no other command has it)")
    lat.add_argument("--spec-replay-k", default="2,4", metavar="KS",
                     help="with --spec-replay-acceptance: drafted tokens per step, comma-separated (default 2,4)")
    srv = sub.add_parser("serve", help="S1: the OpenAI server under a Poisson load (TTFT, ITL, throughput)")
    _add_engine_and_sizes(srv, offline=False)
    add_serve_arguments(srv)
    mt = sub.add_parser("multiturn", help="M1: multi-turn conversations beyond the KV pool (the offload tiers)")
    _add_engine_and_sizes(mt)
    add_serve_arguments(mt, s1=False)
    add_multiturn_arguments(mt)
    mt.set_defaults(request_rate=4.0)
    kv = sub.add_parser("kv-share", help="two engines sharing Redis: TTFT of a prompt loaded from the other's "
                                         "pages against recomputing it")
    _add_engine_and_sizes(kv, offline=False)
    add_kv_share_arguments(kv)
    kt = sub.add_parser("kv-transfer", help="disaggregated prefill/decode: a producer's pages pulled by a consumer "
                                            "(two engine cores on one device): pages/s, GB/s, TTFT")
    _add_engine_and_sizes(kt, offline=False)
    add_kv_transfer_arguments(kt)
    pr = sub.add_parser("prefix-routing", help="precise (KV events) against approximate prefix routing over "
                                               "several engines: a multi-tenant prefix workload")
    add_engine_args(pr)
    pr.set_defaults(model=default_model_dir(), load_format="dummy", dtype="bfloat16", input_len=None, vocab_size=None)
    add_prefix_routing_arguments(pr)
    ep = sub.add_parser("epp-decision", help="the Endpoint Picker's decision time at a request rate, one CPU core")
    add_epp_decision_arguments(ep)


def run(args: argparse.Namespace) -> int:
    if args.bench == "epp-decision":
        from pagoda_engine.bench.epp_decision import run_epp_decision

        result = run_epp_decision(args)
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
    for name in ("num_prompts", "input_len", "output_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {value}", file=sys.stderr)
            return 2
    _resolve_model(args)
    try:  # invalid engine flags (EngineConfig.validate), refused before any engine starts
        apply_lora_arguments(args)
        config = config_from_args(args)
        if getattr(args, "spec_replay_acceptance", None) is not None:
            from pagoda_engine.bench.spec_replay import parse_ks, parse_shares

            parse_shares(args.spec_replay_acceptance)
            parse_ks(args.spec_replay_k)
            if config.speculative_config.enabled:
                raise ValueError("--spec-replay-acceptance drafts with its own proposer: leave out --speculative-config")
            if args.data_parallel_size > 1:
                raise ValueError("--spec-replay-acceptance runs one engine core: leave out --data-parallel-size")
            from pagoda_engine.bench.spec_replay import engine_speculative_config

            args.speculative_config = engine_speculative_config(parse_ks(args.spec_replay_k))
            config = config_from_args(args)
    except (ValueError, TypeError) as e:
        print(f"pagoda bench: {e}", file=sys.stderr)
        return 2
    if args.bench == "serve":
        from pagoda_engine.bench.serve import run_serve

        result = run_serve(args)
    elif args.bench == "multiturn":
        from pagoda_engine.bench.multiturn import run_multiturn

        result = run_multiturn(args)
    elif args.bench == "kv-share":
        from pagoda_engine.bench.kv_share import run_kv_share

        result = run_kv_share(args)
    elif args.bench == "kv-transfer":
        from pagoda_engine.bench.kv_transfer import run_kv_transfer

        result = run_kv_transfer(args, config)
    elif args.bench == "prefix-routing":
        from pagoda_engine.bench.prefix_routing import run_prefix_routing

        result = run_prefix_routing(args)
    else:
        from pagoda_engine.bench.offline import run_latency, run_throughput

        result = run_throughput(args) if args.bench == "throughput" else run_latency(args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    if result.get("bench") in ("serve", "multiturn", "kv-share", "prefix-routing") and not result["completed"]:
        print("error: no request completed", file=sys.stderr)
        return 1
    if result.get("valid") is False:
        return 1
    return 0


def _step_range(text: str) -> tuple[int, int]:
    first, sep, count = text.partition(":")
    if not (sep and first.isdigit() and count.isdigit() and int(count) > 0):
        raise argparse.ArgumentTypeError(f"expected FIRST:COUNT with COUNT > 0, got {text!r}")
    return int(first), int(count)
