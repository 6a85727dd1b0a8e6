"""Response lengths for simulated (and benchmarked) rollouts.

Sample j of group g gets L(g, j) tokens: the group's n lengths are drawn once from a numpy
generator seeded with (seed, g), so every mode, the benchmark and the simulator see the same
lengths for the same group. Lengths are capped at max_len (the generation budget).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class LengthDist:
    kind: str          # lognormal | pareto | fixed
    params: dict

    def draw(self, rng: np.random.Generator, count: int, max_len: int) -> list[int]:
        if self.kind == "lognormal":
            x = np.exp(self.params["mu"] + self.params["sigma"] * rng.standard_normal(count))
        elif self.kind == "pareto":  # type I: xmin * U^(-1/alpha)
            u = 1.0 - rng.random(count)          # (0, 1]
            x = self.params["xmin"] * u ** (-1.0 / self.params["alpha"])
        else:
            x = np.full(count, self.params["len"])
        return [int(v) for v in np.clip(np.rint(x), 1, max_len)]


_NEEDS = {"lognormal": {"mu", "sigma"}, "pareto": {"alpha", "xmin"}, "fixed": {"len"}}
_FORMS = "lognormal:mu=M,sigma=S | pareto:alpha=A,xmin=X | fixed:len=L"


def parse_dist(spec: str) -> LengthDist:
    """lognormal:mu=M,sigma=S | pareto:alpha=A,xmin=X | fixed:len=L"""
    try:
        kind, rest = spec.split(":", 1)
        params = {k.strip(): float(v) for k, v in (kv.split("=") for kv in rest.split(","))}
    except ValueError:
        raise ValueError(f"length distribution {spec!r}: expected {_FORMS}") from None
    if set(params) != _NEEDS.get(kind, set()):
        raise ValueError(f"length distribution {spec!r}: expected {_FORMS}")
    if (kind == "lognormal" and params["sigma"] < 0) or (kind == "pareto" and min(params.values()) <= 0) \
            or (kind == "fixed" and params["len"] < 1):
        raise ValueError(f"length distribution {spec!r}: sigma must be >= 0, alpha, xmin and len > 0")
    return LengthDist(kind, params)


@dataclass
class Workload:
    dist: LengthDist
    n: int
    max_len: int
    seed: int = 0
    prompt_len: Callable[[int], int] = lambda gid: 16
    _cache: dict = field(default_factory=dict, repr=False)

    def length_of(self, gid: int, index: int) -> int:
        if gid not in self._cache:
            rng = np.random.default_rng([self.seed, gid])
            self._cache[gid] = self.dist.draw(rng, self.n, self.max_len)
        return self._cache[gid][index]

    def stats(self, groups: int = 4000) -> dict:
        x = np.array([self.length_of(g, j) for g in range(groups) for j in range(self.n)])
        return {"mean": float(x.mean()), "median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
                "p99": float(np.percentile(x, 99)), "max": int(x.max())}
