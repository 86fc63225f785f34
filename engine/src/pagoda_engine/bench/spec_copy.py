"""`python -m pagoda_engine.bench.spec_copy`: ngram speculative decoding on real weights (the default
model, SmolLM2-135M-Instruct, unless --model) with chat prompts whose answers copy from the prompt
(repeat this list, edit this text): one request at a time, greedy, with and without speculation;
prints tokens/s, the speed-up, vLLM's mean acceptance length, the engine steps each run took and
whether the outputs are identical. The time includes each prompt's prefill, as a user's does.
"""

from __future__ import annotations

import argparse
import json
import time

from pagoda_engine.api.llm import LLM
from pagoda_engine.sampling_params import SamplingParams

PROMPTS = [
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes, "
    "honeydew, kiwis, lemons, mangoes, nectarines.",
    "Edit this text so that every 'colour' becomes 'color', and otherwise copy it unchanged: The colour of the sky "
    "is blue. The colour of grass is green. My favourite colour is red, and the colour of the sea is deep blue.",
    "Copy this Python code and add a docstring to each function:\ndef add(a, b):\n    result = a + b\n    return "
    "result\n\ndef mul(a, b):\n    result = a * b\n    return result",
    "Repeat the following sentence three times: The quick brown fox jumps over the lazy dog.",
    "Copy this paragraph word for word: The river rises in the hills to the north of the town and runs south "
    "through the valley for about forty miles. In spring the water is high and fast, and the old stone bridge "
    "near the market is sometimes closed. In summer the river is low and slow, and children swim in the pools "
    "below the mill. In autumn the trees along the banks turn red and gold, and in winter the edges freeze.",
]


def measure(model: str | None, speculative_config: dict | None, max_tokens: int, **engine) -> dict:
    llm = LLM(model, speculative_config=speculative_config, **engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    outputs, elapsed, steps = [], 0.0, [0]
    step = llm.core.step

    def counted():
        steps[0] += 1
        return step()

    llm.core.step = counted
    for prompt in PROMPTS:  # one stream at a time, as L1
        start = time.perf_counter()
        outputs.append(llm.chat([[{"role": "user", "content": prompt}]], params)[0].outputs[0].token_ids)
        elapsed += time.perf_counter() - start
    tokens = sum(map(len, outputs))
    result = {"tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1),
              "steps": steps[0], "outputs": outputs}
    spec = llm.core.scheduler.spec
    if spec is not None:
        s = spec.stats
        result["mean_acceptance_length"] = round(1 + s.num_accepted_tokens / max(s.num_drafts, 1), 3)
        result["draft_acceptance_rate"] = round(s.num_accepted_tokens / max(s.num_draft_tokens, 1), 4)
    llm.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda_engine.bench.spec_copy")
    p.add_argument("--model", default=None, help="default: the engine's default model (SmolLM2-135M-Instruct)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    # One request at a time needs a few thousand tokens of KV: on CPU the engine would otherwise
    # take `cpu_kv_cache_gb` (4 GB) for each of the two engines.
    p.add_argument("--num-kv-pages", type=int, default=512, help="KV pages of each engine (default 512)")
    args = p.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    engine = dict(dtype=args.dtype, num_kv_pages=args.num_kv_pages)
    plain = measure(args.model, None, args.max_tokens, **engine)
    ngram = measure(args.model, spec, args.max_tokens, **engine)
    summary = {"speculative_config": spec, "without": {k: v for k, v in plain.items() if k != "outputs"},
               "with": {k: v for k, v in ngram.items() if k != "outputs"},
               "speed_up": round(ngram["tokens_per_s"] / plain["tokens_per_s"], 3),
               "identical_outputs": plain["outputs"] == ngram["outputs"]}
    print(json.dumps(summary, indent=2))
    return 0 if summary["identical_outputs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
