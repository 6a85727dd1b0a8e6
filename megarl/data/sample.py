"""What a rollout produces and PPO trains on: one Sample per generated sequence.

Here, below rollout and ppo, so both import it without either importing the other.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One response to one prompt, with what the engine knew when it produced each token."""
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]          # behaviour logprob of each response token (engine)
    versions: list[int]            # policy version that produced each response token
    stopped: bool                  # the engine stopped on EOS / a stop string (not on the token budget)
    group: int                     # index of the prompt's group within the step
    record: dict = field(default_factory=dict)  # the dataset record (answer, metadata)
    reward: float = 0.0
    finish_reason: str = ""        # stop | length | abort, as the engine reported it
    # trainer logprobs (l_old) already computed for a prefix of the response, each under the
    # version that produced its token (partial rollout's stitching); empty: compute them all
    old_logprobs: list[float] = field(default_factory=list)
    # the prompt's number in the run's data stream (the n-th prompt drawn, from 0): the same
    # prompt in an interrupted and an uninterrupted run of one seed; -1 when not known
    uid: int = -1
    # multi-turn episodes (megarl/envs): 1 on model tokens, 0 on observation tokens (context the
    # environment appended: never trained, behaviour logprob 0, the version of the turn before).
    # Empty: every response token is the model's (single-turn samples).
    mask: list[int] = field(default_factory=list)
    turns: int = 0                 # model turns of an episode (0: a single-turn sample)
    # Mixture-of-Experts routing replay: the experts the engine chose for each input token, a
    # numpy array [len(prompt_ids) + len(response_ids) - 1, MoE layers, top-k] (uint8, uint16
    # past 255 experts), row i for token i of prompt + response (the last token is never fed
    # back, so it has no row); each row from the weights that produced the token after it.
    # None: not captured (dense models, or algo.routing_replay other than r3). Fewer rows (at
    # least `routes_needed`): the positions past them feed no trained token (an episode's
    # observation not yet fed to an engine); the trainer gives them filler experts.
    routes: object = None

    @property
    def loss_mask(self) -> list[int]:
        """1 per trained response token: the mask, or all ones for a single-turn sample."""
        return list(self.mask) if self.mask else [1] * len(self.response_ids)

    @property
    def routes_needed(self) -> int:
        """Rows of `routes` the trained logprobs depend on (`routes_needed`)."""
        return routes_needed(len(self.prompt_ids), self.loss_mask)

    @property
    def staleness(self) -> int:
        """Versions between the oldest token and the newest (0 for on-policy samples)."""
        return max(self.versions) - min(self.versions) if self.versions else 0


def routes_needed(prompt_len: int, loss_mask) -> int:
    """Routing replay: the rows of a sample's routes its trained logprobs depend on, those of
    every position before its last trained response token (0 when none trains). Response token
    j sits at position prompt_len + j and is predicted from position prompt_len + j - 1; with
    causal attention the route of position i reaches only the outputs of positions i and after,
    so positions from prompt_len + j on feed no logprob up to token j (docs/moe.md "Routing
    replay")."""
    last = max((j for j, m in enumerate(loss_mask) if m), default=None)
    return 0 if last is None else prompt_len + last
