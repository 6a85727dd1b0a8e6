"""The partial-rollout controller's data: a `Group` of n samples of one prompt, each a `Slot`
holding what has been generated for it so far, and their plain-data form (what a checkpoint
keeps). Nothing here knows about engines or the event loop; the controller
(`controller.py`) mutates these on its loop thread, and a group the driver has taken is the
trainer's (read with `group_samples`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megarl.data.sample import Sample, routes_needed
from megarl.rollout import routes as route_rows
from megarl.rollout.controller.sync_rollout import REFUSED
from megarl.rollout.engines.engine import GenResult


@dataclass
class Slot:
    """One sample of a group: what has been generated for it so far."""
    gid: int
    index: int
    seed: int                                               # seeds.sample_seed of its group's seed and index
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)    # behaviour (engine) logprobs
    versions: list[int] = field(default_factory=list)      # version that produced each token
    old_logprobs: list[float] = field(default_factory=list)  # trainer l_old, stitched (a prefix)
    finish_reason: str = ""                                 # "" until stop | length | refused (then done)
    restarts: int = 0
    attempts: int = 0                                       # requests sent (unique request keys)
    # multi-turn episodes (megarl/envs/episodes.py); unused by single-turn samples
    mask: list[int] = field(default_factory=list)           # 1 model token, 0 observation token
    turns: int = 0                                          # model turns the environment answered
    turn_spans: list[list[int]] = field(default_factory=list)  # [start, end) of each such turn
    turn_base: int = 0                                      # where the current model turn began
    env_reward: float = 0.0                                 # the environment's rewards so far
    env_status: str = ""                                    # "" | error | timeout (reward 0)
    # routing replay: the experts each token of prompt + response was routed to (Sample.routes),
    # as far as captured; None when not asked for
    routes: object = None

    @property
    def done(self) -> bool:
        """Nothing left to generate: stopped (EOS / stop string), at its token budget, or its
        request refused by the engine as invalid (it scores 0)."""
        return self.finish_reason in ("stop", "length", REFUSED)

    def restart(self) -> int:
        """Forget everything generated; returns how many tokens were thrown away."""
        lost = len(self.response_ids)
        self.response_ids, self.logprobs, self.versions, self.old_logprobs = [], [], [], []
        self.mask, self.turn_spans, self.turns, self.turn_base = [], [], 0, 0
        self.env_reward, self.env_status = 0.0, ""
        self.routes = None
        self.finish_reason = ""
        self.restarts += 1
        return lost

    def clip(self, budget: int) -> None:
        """Keep at most `budget` tokens, done on length (a carry restored under a smaller
        rollout.sampling.max_new_tokens: nothing is left to generate)."""
        for name in ("response_ids", "logprobs", "versions", "old_logprobs", "mask"):
            setattr(self, name, getattr(self, name)[:budget])
        self.finish_reason = "length"


@dataclass
class Group:
    """n samples of one prompt."""
    gid: int        # one per new_group() call: the n-th prompt drawn in the run (Sample.uid)
    record: dict
    prompt_ids: list[int]
    slots: list[Slot]
    reward_done: bool = False
    rewards: list[float] = field(default_factory=list)    # one per slot, set when complete
    deadline: Optional[int] = None   # stale_policy=finish: the step that must train it at the latest

    @property
    def done_count(self) -> int:
        return sum(s.done for s in self.slots)

    @property
    def complete(self) -> bool:
        """Every sample done: the group can be scored."""
        return self.done_count == len(self.slots)


def group_state(g: Group) -> dict:
    """A group as plain lists and numbers (what a checkpoint keeps)."""
    return {"gid": g.gid, "record": g.record, "prompt_ids": list(g.prompt_ids),
            "rewards": list(g.rewards), "reward_done": g.reward_done, "deadline": g.deadline,
            "slots": [{k: (list(v) if isinstance(v, list) else route_rows.to_state(v) if k == "routes" else v)
                       for k, v in vars(s).items()} for s in g.slots]}


def group_from_state(d: dict) -> Group:
    """The inverse of `group_state`."""
    slots = [Slot(**{**s, "routes": route_rows.from_state(s.get("routes"))}) for s in d["slots"]]
    return Group(d["gid"], d["record"], list(d["prompt_ids"]), slots,
                 d["reward_done"], list(d["rewards"]), d.get("deadline"))


def set_tokens(slot: Slot, base: int, r: GenResult, episode: bool = False, prompt_len: int = 0) -> None:
    """The slot's first `base` tokens, then what its request produced (a held request's
    partial, or its final result, of which every earlier partial is a prefix). An episode's
    slot also marks the new tokens as the model's (mask 1). Routes: the rows of the tokens the
    request found (its prompt is the group's `prompt_len` tokens + the first `base`), then the
    request's own (routes.continued)."""
    slot.routes = route_rows.continued(slot.routes, base, prompt_len, r.routes)
    slot.response_ids = slot.response_ids[:base] + list(r.token_ids)
    slot.logprobs = slot.logprobs[:base] + list(r.logprobs)
    slot.versions = slot.versions[:base] + list(r.versions)
    if episode:
        slot.mask = slot.mask[:base] + [1] * len(r.token_ids)


def group_samples(group: Group, local_index: int = 0) -> list[Sample]:
    """The group's samples as the trainer sees them (copies), with the group's rewards."""
    out = []
    for s in group.slots:
        smp = Sample(group.prompt_ids, list(s.response_ids), list(s.logprobs), list(s.versions),
                     s.finish_reason == "stop", local_index, group.record, reward=s.env_reward,
                     finish_reason=s.finish_reason or "abort", old_logprobs=list(s.old_logprobs),
                     uid=group.gid, mask=list(s.mask), turns=s.turns,
                     routes=sample_routes(group, s))
        out.append(smp)
    for smp, r in zip(out, group.rewards):
        smp.reward = r
    return out


def sample_routes(group: Group, slot: Slot):
    """The slot's routes for the trainer (routes.usable): one row per token of prompt +
    response but the last, or fewer when they cover every position before its last model
    token (an episode between turns: its observation was never fed); None when they do not."""
    p, n = len(group.prompt_ids), len(slot.response_ids)
    return route_rows.usable(slot.routes, route_rows.expected_rows(p, n),
                             routes_needed(p, slot.mask or [1] * n))


def sample_identity(group: Group) -> tuple:
    """What a group's score is a score of: each slot's generation (restarts), length and end.
    Equal before and after a scoring means the score is of the samples the group holds now."""
    return tuple((s.restarts, len(s.response_ids), s.finish_reason) for s in group.slots)


def store_old_logprobs(slot: Slot, restarts: int, length: int, values: list[float]) -> None:
    """Keep the stored prefix; append the newly computed suffix (stitching). `restarts`
    and `length` describe the snapshot the values were computed for: a slot restarted
    since is left alone, and tokens generated since stay without a stored value."""
    if slot.restarts != restarts or len(slot.response_ids) < length:
        return
    slot.old_logprobs = slot.old_logprobs + list(values[len(slot.old_logprobs):length])
