"""The data stream over a weighted mixture of sources (data.prompts = {file: weight}, docs/data.md).

Each draw picks a source with probability weight / sum(weights), from a generator seeded by
(run seed, the draw's number); the source then gives its next prompt from its own epochs, each
reshuffled as a single file's are (`PromptSampler`). The state is the draw count and each
source's (epoch, cursor): a resumed run draws exactly what an uninterrupted one would.
"""
from __future__ import annotations

import bisect
import itertools
import random

from megarl.config.errors import ConfigError
from megarl.data.prompts import PromptSampler
from megarl.data.seeds import mixture_pick_seed, mixture_source_seed


class MixtureSampler:
    """Draws indices into the concatenated records of the sources (source i's rows at
    offsets[i] .. offsets[i] + sizes[i]); the same interface as PromptSampler."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int, shuffle: bool = True):
        if len(sizes) != len(weights) or not sizes or min(sizes) < 1:
            raise ValueError(f"MixtureSampler: sizes {sizes} and weights {weights} must pair up, each source non-empty")
        self.sizes, self.weights, self.seed = list(sizes), list(weights), seed
        self.parts = [PromptSampler(n, mixture_source_seed(seed, i), shuffle) for i, n in enumerate(sizes)]
        self.offsets = [0, *itertools.accumulate(sizes)][:-1]
        self._cum = list(itertools.accumulate(weights))
        self.drawn = 0   # prompts taken so far (a resumed sampler counts those before its checkpoint)

    def pick(self, n: int) -> int:
        """The source of the n-th draw of the run (a pure function of the seed and n)."""
        u = random.Random(mixture_pick_seed(self.seed, n)).random() * self._cum[-1]
        return min(bisect.bisect_right(self._cum, u), len(self.sizes) - 1)

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            i = self.pick(self.drawn)
            out.append(self.offsets[i] + self.parts[i].take(1)[0])
            self.drawn += 1
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "sizes": list(self.sizes), "sources": [p.state_dict() for p in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        if "sources" not in state or len(state["sources"]) != len(self.parts):
            had = len(state["sources"]) if "sources" in state else "one file, no mixture"
            raise ConfigError(f"data.prompts: the checkpoint's data stream was drawn from {had} sources and "
                              f"data.prompts now names a mixture of {len(self.parts)}: resume with the "
                              f"data.prompts it was written with, or start a new run.dir")
        self.drawn = state["drawn"]
        for part, s in zip(self.parts, state["sources"]):
            part.load_state_dict(s)


def make_sampler(records, seed: int, shuffle: bool = True):
    """The run's data stream over `records` (megarl.data.prompts.load_dataset): a MixtureSampler
    when data.prompts is a mixture (records.weights set), else one PromptSampler over all rows."""
    weights = getattr(records, "weights", None)
    if not weights:
        return PromptSampler(len(records), seed, shuffle)
    return MixtureSampler(records.source_sizes(), weights, seed, shuffle)
