"""`pagoda bench latency --spec-replay-acceptance 0,0.5,0.8,1 --spec-replay-k 2,4`: what speculative
decoding's verification costs and saves at a chosen acceptance, on weights (dummy ones) whose own
drafts would mean nothing.

A benchmark tool, reachable from `pagoda bench` only: the proposer (`ReplayProposer`) knows each
prompt's greedy continuation and drafts it back, each drafted token replaced by another with
probability 1 - acceptance. The run is greedy throughout (so that the continuation is what the
target writes), first without speculation (the baseline, with async scheduling where the engine
has it), then once per (k, acceptance), with the continuation that run itself writes (`_settle`:
a verification step's bf16 sums may flip a near-tie that plain decoding did not); each reports ms per output
token and the acceptance the engine measured (vLLM's mean acceptance length and draft acceptance
rate: a draft after a replaced one is not verified, so the rate is below the share kept).
"""

from __future__ import annotations

import json
import statistics

import numpy as np

from pagoda_engine.bench.workloads import Workload
from pagoda_engine.core.request import Request
from pagoda_engine.core.spec_decode import SpecDecoder
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from pagoda_engine.sampling_params import SamplingParams


# Settling runs per (k, acceptance) before the replayed continuation is taken as it stands.
MAX_SETTLE_ROUNDS = 8


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
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        """Draw the corruptions of the first run again: a rerun of the same requests drafts alike."""
        self.rng = np.random.default_rng(self.seed)

    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        drafts = []
        for req, k in zip(reqs, max_drafts):
            cont = self.continuations[tuple(req.prompt_token_ids)]
            at = req.num_output_tokens
            draft = cont[at:at + k]
            # Drawn a draft at a time: the proposer runs in the timed step's critical path.
            kept = self.rng.random(len(draft)) < self.acceptance
            shifts = self.rng.integers(self.vocab_size - 1, size=len(draft))
            drafts.append([t if keep else (t + 1 + int(d)) % self.vocab_size
                           for t, keep, d in zip(draft, kept.tolist(), shifts.tolist())])
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


def engine_speculative_config(ks: list[int]) -> str:
    """The `--speculative-config` the engine starts with: speculation at the largest k, so that it
    sets up what verification steps of up to that many drafts run in (their CUDA graphs, captured
    for k + 1 rows a request, serve smaller k too); each run then sets its own proposer, or none
    for the baseline (`run_spec_replay`)."""
    return json.dumps({"method": "ngram", "num_speculative_tokens": max(ks)})


def run_spec_replay(core, wl, drive, num_iters: int, shares: list[float], ks: list[int],
                    max_rounds: int = MAX_SETTLE_ROUNDS) -> dict:
    """`drive(core, wl, tag)`: the latency bench's driver. Returns the figures per (k, acceptance)."""
    greedy = _Greedy(wl.name, wl.description + ", greedy", wl.prompts, wl.output_lens)
    out_len = wl.output_lens[0]
    core.scheduler.spec = None
    plain = _outputs(core, greedy, "replay")

    def timed(tag: str, before=lambda: None) -> dict:
        before()
        drive(core, greedy, f"{tag}-warmup")
        runs = []
        for it in range(num_iters):
            before()
            runs.append(drive(core, greedy, f"{tag}-{it}"))
        return {"ms_per_output_token": round(statistics.median(r["elapsed_s"] for r in runs) / out_len * 1e3, 3)}

    baseline = timed("baseline")
    print(f"no speculation: {baseline['ms_per_output_token']:.3f} ms per output token (greedy)")
    results = {"baseline": baseline, "runs": []}
    for k in ks:
        config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=1, prompt_lookup_min=1)
        for share in shares:
            continuations, rounds, matched = _settle(core, greedy, config, plain, share, max_rounds)
            proposer = ReplayProposer(continuations, share, core.vocab_size)
            core.scheduler.spec = spec = SpecDecoder(config, proposer)
            figures = timed(f"k{k}-a{share}", before=proposer.reset)
            s = spec.stats
            figures.update(k=k, acceptance=share, mean_acceptance_length=round(1 + s.num_accepted_tokens / max(s.num_drafts, 1), 3),
                           draft_acceptance_rate=round(s.num_accepted_tokens / max(s.num_draft_tokens, 1), 4),
                           vs_baseline=round(figures["ms_per_output_token"] / baseline["ms_per_output_token"], 3),
                           settle_rounds=rounds, replay_matched=round(matched, 4))
            results["runs"].append(figures)
            print(f"k={k} acceptance {share:.0%}: {figures['ms_per_output_token']:.3f} ms per output token "
                  f"({figures['vs_baseline']:.3f} x no speculation; mean acceptance length "
                  f"{figures['mean_acceptance_length']:.2f}, draft acceptance rate {figures['draft_acceptance_rate']:.1%}; "
                  f"replayed continuation {matched:.1%} the run's own after {rounds} settling runs)")
    core.scheduler.spec = None
    return results


def _settle(core, wl, config: SpeculativeConfig, continuations: dict[tuple[int, ...], list[int]], share: float,
            max_rounds: int) -> tuple[dict[tuple[int, ...], list[int]], int, float]:
    """The continuation a speculating run at (k, share) itself writes, so that its drafts can be replayed.

    A verification step scores k + 1 positions in one forward, with other kernels and other
    summation orders than a one-token decode; in bf16 the greedy token can then differ where the top
    two logits are within rounding, and random (dummy) weights make such near-ties common and
    amplify any difference layer by layer. One differing token and the run's later context is no
    longer the recorded one: every later draft misses (an 8B model's dummy weights on an H200 kept
    none). So the continuation is rerun with the same drafts (same seed) until the run writes what
    it replays: each round the two agree at least one token further. Returns the continuation,
    the rounds run, and the share of its tokens the last round wrote alike."""
    matched = 0.0
    for rounds in range(1, max_rounds + 1):
        core.scheduler.spec = SpecDecoder(config, ReplayProposer(continuations, share, core.vocab_size))
        written = _outputs(core, wl, f"settle-k{config.num_speculative_tokens}-a{share}-{rounds}")
        total = sum(len(c) for c in continuations.values())
        same = sum(sum(1 for _ in _common_prefix(continuations[p], written[p])) for p in continuations)
        matched = same / max(total, 1)
        if written == continuations:
            return continuations, rounds, 1.0
        continuations = written
    core.scheduler.spec = None
    return continuations, max_rounds, matched


def _common_prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def _outputs(core, wl, tag: str) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's output tokens (keyed by the prompt)."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(wl.prompts):
        core.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt,
                                           sampling_params=wl.sampling_params(i)))
        tokens[f"{tag}-{i}"] = []
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return {tuple(prompt): tokens[f"{tag}-{i}"] for i, prompt in enumerate(wl.prompts)}
