"""`pagoda bench latency --spec-replay-acceptance 0,0.5,0.8,1 --spec-replay-k 2,4`: what speculative
decoding's verification costs and saves at a chosen acceptance, on weights (dummy ones) whose own
drafts would mean nothing.

A benchmark tool, reachable from `pagoda bench` only: the proposer (`ReplayProposer`) knows each
prompt's greedy continuation from a run without speculation and drafts it back, each drafted token
replaced by another with probability 1 - acceptance. The run is greedy throughout (so that the
continuation is what the target writes), first without speculation (the baseline, with async
scheduling where the engine has it), then once per (k, acceptance); each reports ms per output
token and the acceptance the engine measured (vLLM's mean acceptance length and draft acceptance
rate: a draft after a replaced one is not verified, so the rate is below the share kept).
"""

from __future__ import annotations

import statistics

import numpy as np

from pagoda_engine.bench.workloads import Workload
from pagoda_engine.core.request import Request
from pagoda_engine.core.spec_decode import SpecDecoder
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from pagoda_engine.sampling_params import SamplingParams


class _Greedy(Workload):
    def sampling_params(self, i: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.output_lens[i], ignore_eos=True)


class ReplayProposer:
    """Drafts each request's recorded greedy continuation from its current output position,
    corrupting each drafted token with probability 1 - `acceptance` (seeded: reruns draft alike)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], acceptance: float, vocab_size: int,
                 seed: int = 0):
        self.continuations = continuations
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(reqs, max_drafts):
            cont = self.continuations[tuple(req.prompt_token_ids)]
            at = req.num_output_tokens
            draft = list(cont[at:at + k])
            for j, token in enumerate(draft):
                if self.rng.random() >= self.acceptance:
                    draft[j] = (token + 1 + int(self.rng.integers(self.vocab_size - 1))) % self.vocab_size
            drafts.append(draft)
        return drafts


def parse_shares(text: str) -> list[float]:
    shares = [float(x) for x in text.split(",")]
    if not shares or any(not 0.0 <= s <= 1.0 for s in shares):
        raise ValueError(f"--spec-replay-acceptance: shares in [0, 1], comma-separated, got {text!r}")
    return shares


def parse_ks(text: str) -> list[int]:
    ks = [int(x) for x in text.split(",")]
    if not ks or any(not 1 <= k <= MAX_SPECULATIVE_TOKENS for k in ks):
        raise ValueError(f"--spec-replay-k: values in [1, {MAX_SPECULATIVE_TOKENS}], comma-separated, got {text!r}")
    return ks


def run_spec_replay(core, wl, drive, num_iters: int, shares: list[float], ks: list[int]) -> dict:
    """`drive(core, wl, tag)`: the latency bench's driver. Returns the figures per (k, acceptance)."""
    greedy = _Greedy(wl.name, wl.description + ", greedy", wl.prompts, wl.output_lens)
    out_len = wl.output_lens[0]
    core.scheduler.spec = None
    continuations = _greedy_continuations(core, greedy)

    def timed(tag: str) -> dict:
        drive(core, greedy, f"{tag}-warmup")
        runs = [drive(core, greedy, f"{tag}-{it}") for it in range(num_iters)]
        return {"ms_per_output_token": round(statistics.median(r["elapsed_s"] for r in runs) / out_len * 1e3, 3)}

    baseline = timed("baseline")
    print(f"no speculation: {baseline['ms_per_output_token']:.3f} ms per output token (greedy)")
    results = {"baseline": baseline, "runs": []}
    for k in ks:
        for share in shares:
            config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=1,
                                       prompt_lookup_min=1)
            core.scheduler.spec = spec = SpecDecoder(config, ReplayProposer(continuations, share, core.vocab_size))
            figures = timed(f"k{k}-a{share}")
            s = spec.stats
            figures.update(k=k, acceptance=share, mean_acceptance_length=round(1 + s.num_accepted_tokens / max(s.num_drafts, 1), 3),
                           draft_acceptance_rate=round(s.num_accepted_tokens / max(s.num_draft_tokens, 1), 4),
                           vs_baseline=round(figures["ms_per_output_token"] / baseline["ms_per_output_token"], 3))
            results["runs"].append(figures)
            print(f"k={k} acceptance {share:.0%}: {figures['ms_per_output_token']:.3f} ms per output token "
                  f"({figures['vs_baseline']:.3f} x no speculation; mean acceptance length "
                  f"{figures['mean_acceptance_length']:.2f}, draft acceptance rate {figures['draft_acceptance_rate']:.1%})")
    core.scheduler.spec = None
    return results


def _greedy_continuations(core, wl) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's output, run without speculation (the drafts to replay)."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(wl.prompts):
        core.add_request(EngineCoreRequest(request_id=f"replay-{i}", prompt_token_ids=prompt,
                                           sampling_params=wl.sampling_params(i)))
        tokens[f"replay-{i}"] = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return {tuple(prompt): tokens[f"replay-{i}"] for i, prompt in enumerate(wl.prompts)}
