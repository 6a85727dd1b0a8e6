"""Samples a user can read: `<run_dir>/samples/step_<N>.jsonl`, one JSON object per sample.

What the engine did, for audit: prompt and response as text and token ids, the behaviour
logprob and weight version of every response token, the finish reason and the reward; for
a multi-turn episode also its loss mask (0 on observation tokens) and number of turns; under
routing replay the experts each token was routed to.
Written to a temporary name and renamed, so a crash never leaves half a file.
"""
from __future__ import annotations

import json
import os

from megarl.data.sample import Sample
from megarl.rollout import routes


def sample_record(s: Sample, tokenizer) -> dict:
    return {"group": s.group, "uid": s.uid,
            "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=False),
            "response": tokenizer.decode(s.response_ids, skip_special_tokens=False),
            "prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids),
            "logprobs": [float(x) for x in s.logprobs], "versions": [int(v) for v in s.versions],
            "finish_reason": s.finish_reason or ("stop" if s.stopped else "length"),
            "reward": float(s.reward),
            # episodes: 1 on model tokens, 0 on the environment's observation tokens
            **({"mask": [int(m) for m in s.mask], "turns": s.turns} if s.mask else {}),
            # routing replay: the engine's experts per token (routes.to_state: dtype, shape, base64)
            **({"routes": routes.to_state(s.routes)} if s.routes is not None else {})}


def dump_samples(run_dir: str, step: int, samples: list[Sample], tokenizer) -> str:
    folder = os.path.join(run_dir, "samples")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for s in samples:
            f.write(json.dumps(sample_record(s, tokenizer)) + "\n")
    os.replace(tmp, path)
    return path


def read_samples(path: str) -> list[Sample]:
    """Samples back from a dump (a recorded rollout to replay a training step on)."""
    samples = []
    with open(path) as f:
        for row, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                samples.append(Sample(r["prompt_ids"], r["response_ids"], r["logprobs"], r["versions"],
                                      r["finish_reason"] == "stop", r["group"], reward=r["reward"],
                                      finish_reason=r["finish_reason"], uid=r.get("uid", -1),
                                      mask=list(r.get("mask", [])), turns=int(r.get("turns", 0)),
                                      routes=routes.from_state(r.get("routes"))))
            except (ValueError, KeyError) as err:
                raise ValueError(f"{path}, row {row}: not a megarl sample record ({err!r})") from None
    return samples
