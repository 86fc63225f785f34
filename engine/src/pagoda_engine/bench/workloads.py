"""The benchmark workloads of docs/benchmarks.md, as token-id prompts (no tokenizer, no download).

Every workload draws from `numpy.random.default_rng(0)`, so the same name always gives the same
requests. Sampling is temperature 1.0 with `ignore_eos`: every request produces exactly its
output length, whatever the (dummy) weights say.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagoda_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def sampling_params(self, i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=self.output_lens[i], ignore_eos=True)


def fixed_lengths(name: str, vocab_size: int, num_requests: int, input_len: int, output_len: int,
                  seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(num_requests, input_len), dtype=np.int64)
    return Workload(name, f"{num_requests} requests x {input_len} input x {output_len} output tokens",
                    ids.tolist(), [output_len] * num_requests)


def uniform_lengths(name: str, vocab_size: int, num_requests: int, low: int, high: int) -> Workload:
    """Input and output lengths each uniform in [low, high]."""
    rng = np.random.default_rng(0)
    input_lens = rng.integers(low, high + 1, size=num_requests)
    output_lens = rng.integers(low, high + 1, size=num_requests)
    prompts = [rng.integers(0, vocab_size, size=int(n), dtype=np.int64).tolist() for n in input_lens]
    return Workload(name, f"{num_requests} requests, input and output lengths uniform in [{low}, {high}]",
                    prompts, [int(n) for n in output_lens])


# name -> (builder, arguments); `scale` overrides exist for smoke runs only and are reported as such.
WORKLOADS = {
    "T1": lambda vocab, n=None, i=None, o=None: fixed_lengths("T1", vocab, n or 1000, i or 1024, o or 512),
    "N1": lambda vocab, n=None, i=None, o=None: uniform_lengths("N1", vocab, n or 256, 100, 1024),
    "L1": lambda vocab, n=None, i=None, o=None: fixed_lengths("L1", vocab, n or 1, i or 128, o or 512),
}


def build_workload(name: str, vocab_size: int, num_requests: int | None = None, input_len: int | None = None,
                   output_len: int | None = None) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name](vocab_size, num_requests, input_len, output_len)
