"""The synthetic serving workload: when requests arrive and how long they are.

Distribution (all drawn from one seed, so a run is reproducible):

- **Arrivals**: a Poisson process in engine steps, ``rate`` requests per step on average
  (exponential gaps). Counting time in steps rather than seconds makes the schedule,
  and so every number of the report except the timings, the same on every machine.
- **Prompts**: with probability ``system_share`` the prompt starts with one shared
  system prompt of ``system_len`` tokens (what prefix caching reuses), followed by a
  user part whose length is log-normal (median ``prompt_median`` tokens, log-space
  sigma ``prompt_sigma``), clipped to [``prompt_min``, ``prompt_max``]. Log-normal
  lengths with a long right tail are what chat traces (e.g. ShareGPT) look like.
- **Outputs**: log-normal, median ``output_median``, sigma ``output_sigma``, clipped to
  [``output_min``, ``output_max``] tokens; every sample of a request generates exactly
  that many tokens (no end-of-sequence token: the weights are random).
- **Parallel sampling**: a request asks for n samples, n drawn from ``n_choices`` with
  probabilities ``n_probs``; its sequence is forked n - 1 times after the prefill.

Token ids are uniform over the vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["WorkloadConfig", "Request", "make_workload"]


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    num_requests: int = 256
    rate: float = 1.5  # requests per engine step
    system_len: int = 64
    system_share: float = 0.8
    prompt_median: float = 48.0
    prompt_sigma: float = 0.8
    prompt_min: int = 8
    prompt_max: int = 512
    output_median: float = 40.0
    output_sigma: float = 0.7
    output_min: int = 4
    output_max: int = 256
    n_choices: Sequence[int] = (1, 2, 4)
    n_probs: Sequence[float] = (0.85, 0.10, 0.05)

    def max_tokens(self) -> int:
        """The longest sequence this workload can produce (system + prompt + output)."""
        return self.system_len + self.prompt_max + self.output_max

    def describe(self) -> list[str]:
        """Three lines for the demo's header."""
        ns = ", ".join(f"n={n} {p:.0%}" for n, p in zip(self.n_choices, self.n_probs))
        return [
            f"{self.num_requests} requests, Poisson arrivals {self.rate:g}/step; {self.system_share:.0%} start with "
            f"a {self.system_len}-token shared system prompt; samples per request: {ns}",
            f"user prompt log-normal(median {self.prompt_median:g}, sigma {self.prompt_sigma:g}) in "
            f"[{self.prompt_min}, {self.prompt_max}] tokens",
            f"output log-normal(median {self.output_median:g}, sigma {self.output_sigma:g}) in "
            f"[{self.output_min}, {self.output_max}] tokens",
        ]


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int  # engine step at which it can be admitted
    prompt: np.ndarray  # int32 [prompt length]
    output_len: int  # tokens each sample generates
    n: int  # samples (sequences) of this request
    shares_system_prompt: bool


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int, size: int) -> np.ndarray:
    x = rng.lognormal(mean=np.log(median), sigma=sigma, size=size)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def make_workload(cfg: WorkloadConfig, vocab: int, seed: int) -> list[Request]:
    """The requests of a run, sorted by arrival step."""
    if cfg.num_requests < 1:
        raise ValueError(f"--requests must be at least 1, got {cfg.num_requests}")
    if cfg.rate <= 0:
        raise ValueError(f"--rate must be positive, got {cfg.rate}")
    if len(cfg.n_choices) != len(cfg.n_probs) or abs(sum(cfg.n_probs) - 1.0) > 1e-9:
        raise ValueError("workload: n_choices and n_probs must have the same length and n_probs must sum to 1")
    rng = np.random.default_rng([seed, 1])
    n = cfg.num_requests
    arrivals = np.floor(np.cumsum(rng.exponential(1.0 / cfg.rate, size=n))).astype(np.int64)
    arrivals -= arrivals[0]  # the first request arrives at step 0
    prompt_lens = _lognormal_int(rng, cfg.prompt_median, cfg.prompt_sigma, cfg.prompt_min, cfg.prompt_max, n)
    output_lens = _lognormal_int(rng, cfg.output_median, cfg.output_sigma, cfg.output_min, cfg.output_max, n)
    shares = rng.random(n) < cfg.system_share
    samples = rng.choice(np.asarray(cfg.n_choices), size=n, p=np.asarray(cfg.n_probs))
    system = rng.integers(0, vocab, size=cfg.system_len, dtype=np.int32)
    requests = []
    for i in range(n):
        user = rng.integers(0, vocab, size=int(prompt_lens[i]), dtype=np.int32)
        prompt = np.concatenate([system, user]) if shares[i] else user
        requests.append(
            Request(rid=i, arrival=int(arrivals[i]), prompt=prompt, output_len=int(output_lens[i]),
                    n=int(samples[i]), shares_system_prompt=bool(shares[i]))
        )  # fmt: skip
    return requests
