"""Synchronous rollout: generate every sample of the step, then score them.

The baseline the partial-rollout controller is measured against: the step waits for its
longest response. It runs on the same engine pool and protocol as the controller.

A request the engines refuse as invalid (`RequestError`: a prompt longer than the engines'
max_model_len, token ids outside the vocabulary, sampling options they do not take) does not
stop the run: its sample comes back refused (no response tokens, finish_reason "refused",
reward 0 without asking the verifier; its group's other samples train as usual), and the step
logs how many and why. A step whose every sample was refused has nothing to train on: it stops
the run with the engine's message. Data rows the engines would refuse are caught before the run
where they can be (megarl/preflight.py `prompts_problem`).
"""
from __future__ import annotations

import logging
from typing import Optional

from megarl.data.sample import Sample
from megarl.data.seeds import sample_seed
from megarl.rollout import routes
from megarl.rollout.controller.scoring import REFUSED
from megarl.rollout.engines.engine import GenRequest, RequestError

log = logging.getLogger("megarl.engines")


def group_requests(prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                   seeds: list[int] | None, tag: str = "", top_p: float = 1.0, top_k: int = -1) -> list[GenRequest]:
    """n requests per prompt, in group order. Sample j of prompt i is drawn from its own
    generator seeded seeds.sample_seed(seeds[i], j), so a run is reproducible from its seed
    whatever the engines did before (e.g. after a resume) and whichever engine serves it.
    top_p / top_k: rollout.sampling's cut (the trainer renormalises its logprobs over it)."""
    return [GenRequest(f"{tag}g{i}s{j}", p, max_new_tokens, temperature, top_p=top_p, top_k=top_k,
                       seed=None if seeds is None else sample_seed(seeds[i], j))
            for i, p in enumerate(prompts) for j in range(n)]


async def generate_groups(pool, records: list[dict], prompts: list[list[int]], n: int,
                          max_new_tokens: int, seeds: list[int] | None = None, temperature: float = 1.0,
                          tag: str = "", first_uid: int = 0, top_p: float = 1.0, top_k: int = -1) -> list[Sample]:
    """n samples per prompt from the engine pool (an EnginePool, on its loop), unscored, in
    group order (group g = records[g], uid first_uid + g). Token versions are the ones the
    engines reported. Refused requests give refused samples (module docstring)."""
    requests = group_requests(prompts, n, max_new_tokens, temperature, seeds, tag, top_p, top_k)
    outcomes = await pool.generate_each(requests)
    refused = [o for o in outcomes if isinstance(o, RequestError)]
    if refused and len(refused) == len(outcomes):
        raise all_refused(len(refused), refused[0])
    if refused:
        log.warning("megarl: the engines refused %d of %d samples as invalid; they score 0 (finish_reason %r). "
                    "The first: %s", len(refused), len(outcomes), REFUSED, refused[0])
    return samples_of(outcomes, records, prompts, n, first_uid)


def samples_of(outcomes: list, records: list[dict], prompts: list[list[int]], n: int,
               first_uid: int = 0) -> list[Sample]:
    """The unscored samples of `outcomes` (n per prompt, in group order: results, or the
    RequestError a request was refused with, which gives a refused sample)."""
    samples = []
    for k, r in enumerate(outcomes):
        g = k // n
        if isinstance(r, RequestError):
            samples.append(Sample(prompts[g], [], [], [], False, g, records[g], finish_reason=REFUSED,
                                  uid=first_uid + g))
        else:
            samples.append(Sample(prompts[g], r.token_ids, r.logprobs, r.versions, r.stopped, g, records[g],
                                  finish_reason=r.finish_reason, uid=first_uid + g,
                                  routes=routes.fit(r.routes, routes.expected_rows(len(prompts[g]), len(r.token_ids)))))
    return samples


def all_refused(count: int, first: Optional[RequestError]) -> RequestError:
    """The error of a step whose every sample (`count`) the engines refused: nothing to train
    on; it names the first refusal (the engine's message) where the caller saw one."""
    return RequestError(f"the engines refused every sample of the step ({count}), nothing to train on; "
                        f"the first: {first}", getattr(first, "key", ""))
