"""Routing replay, rollout side: the experts the engine chose for each token, as arrays
[positions, MoE layers, top-k] (uint8; uint16 past 255 experts), and their rules of joining.

Row i is for input token i of prompt + response: the experts that token went to when it was fed
to produce token i + 1 (`Sample.routes`). A request's rows cover its own prompt and every token it
produced but the last (never fed back): `expected_rows`.

Joining (`join`): a sample continued after an abort, on another engine, or as the next turn of
an episode is sent as a new request whose prompt holds the tokens so far. The engine feeds all of
them again (under the weights it holds now), but the rows that count for a token are the ones
that produced the token after it: the earlier rows are kept, and the new request adds rows only
for positions past them. The same holds for a request held over a weight update in keep mode:
the engine itself keeps the first row of every position (route_capture.py).

A sample's routes for the trainer (`usable`): every row, or fewer when the rows still cover
every position before its last trained token (`Sample.routes_needed`): an episode carried
between turns has none for its observation tokens (appended, not yet fed to an engine; in keep
mode also when its next turn is held before its prefill), and a refused sample none at all.
Those positions feed no trained logprob (causal attention); the trainer gives them filler
experts, as it does padding (ppo/route_layout.py), and leaves them out of routing_agreement.

Where routes are asked for: `wanted(cfg)`, from `algo.routing_replay` (r3 replays the engine's
routes in the trainer).
"""
from __future__ import annotations

import base64
from typing import Optional

import numpy as np


def wanted(cfg) -> bool:
    """Whether the rollout captures the engine's routes: algo.routing_replay=r3."""
    algo = getattr(cfg, "algo", None)
    return str(getattr(algo, "routing_replay", "off") or "off").lower() == "r3"


def expected_rows(prompt_len: int, response_len: int) -> int:
    """Rows of a sequence of prompt + response tokens: every token but the last."""
    return max(prompt_len + response_len - 1, 0)


def fit(rows, n: int):
    """The first `n` rows, or None when fewer were captured (a route not captured for every
    token is no route: replay needs each one)."""
    if rows is None or len(rows) < n:
        return None
    return rows[:n]


def usable(rows, n: int, need: int):
    """A sample's rows for the trainer: the first `n` (one per input token), or all it has
    when fewer but at least `need` (the positions its trained tokens depend on:
    Sample.routes_needed; the rest get filler experts); None when even those are not there."""
    if rows is None or len(rows) < need:
        return None
    return rows[:n]


def join(old, new, keep: int):
    """Rows of a continued sequence: `old`'s first `keep` rows (those that produced tokens the
    continuation keeps; fewer when `old` has fewer: an episode's observation tokens were never
    fed before), then `new`'s rows past them. `new` covers the continuation's whole input from
    position 0. `old`'s rows where `new` is missing."""
    if new is None:
        # a running request's partial without fresh rows (they are read at pauses): the rows
        # so far stay (its own earlier rows included: the engine never rewrites a row)
        return None if old is None else old.copy()
    k = 0 if old is None else min(max(keep, 0), len(old))
    if len(new) <= k:
        return old[:k].copy()
    return new if k == 0 else np.concatenate([old[:k], new[k:]], axis=0)


def continued(old, served: int, prompt_len: int, new):
    """Rows of a request continued after `served` tokens as a new request whose prompt is the
    prompt + those tokens (`new` covers that prompt from position 0): nothing served, `new`
    (or, for a running request's partial without rows, the rows it had)."""
    return join(old, new, prompt_len + served - 1 if served else 0)


def nbytes(samples) -> int:
    """Bytes of the samples' routes."""
    return int(sum(s.routes.nbytes for s in samples if getattr(s, "routes", None) is not None))


def metrics(samples) -> dict:
    """The step's `route_bytes` (what the trainer receives for replay) and the samples without
    routes among those with a response; nothing when no sample has routes (not asked for)."""
    with_routes = sum(getattr(s, "routes", None) is not None for s in samples)
    if not with_routes:
        return {}
    return {"route_bytes": nbytes(samples),
            "samples_without_routes": sum(getattr(s, "routes", None) is None and bool(s.response_ids) for s in samples)}


# -- plain-data form: checkpoints keep slots as JSON-like state -----------------------------------
def to_state(rows) -> Optional[dict]:
    if rows is None:
        return None
    rows = np.ascontiguousarray(rows)
    return {"dtype": str(rows.dtype), "shape": list(rows.shape),
            "data": base64.b64encode(rows.tobytes()).decode()}


def from_state(d) -> Optional[np.ndarray]:
    if d is None or isinstance(d, np.ndarray):
        return d
    return np.frombuffer(base64.b64decode(d["data"]), dtype=d["dtype"]).reshape(d["shape"]).copy()


def sample_state(d: dict) -> dict:
    """A Sample's fields (dataclasses.asdict) with its routes in plain-data form: checkpoints
    are loaded with torch.load(weights_only=True), which refuses numpy arrays."""
    return {**d, "routes": to_state(d.get("routes"))}


def sample_from_state(d: dict) -> dict:
    """The inverse of `sample_state` (a checkpoint from before routes existed has none)."""
    return {**d, "routes": from_state(d.get("routes"))}
