"""What one partial-rollout round did (`RoundStats`), and the round's metrics built from it.

The controller (`partial.py`) counts into a fresh `RoundStats` each round and samples its
occupancy (requests in flight, engines busy) on every event and on a timer; `round_metrics`
turns the counts into the per-step metrics the trainer logs (docs/partial_rollout.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.rollout.controller.group_filter import filter_metrics


@dataclass
class RoundStats:
    """What one round did; turned into per-step metrics by `round_metrics()`."""
    started: float = 0.0
    ended: float = 0.0
    inflight_area: float = 0.0           # integral of in-flight count over time
    inflight_min: Optional[int] = None   # lowest in-flight count while the round ran (events + timer)
    busy_area: float = 0.0               # integral of (engines with >= 1 request) over time
    last_t: float = 0.0
    last_inflight: int = 0
    last_busy: int = 0
    timer_samples: int = 0               # occupancy samples taken by the timer (not on events)
    loop_lag_max: float = 0.0            # longest the timer woke late: the event loop was blocked
    requests: int = 0                    # results absorbed
    sent: int = 0                        # requests admitted (a held one counts once, where it was sent)
    reprefill_tokens: int = 0            # continuation tokens sent again (abort mode) + KV recomputed
    spanning_requests: int = 0           # results whose tokens came from more than one version
    spanning_tokens: int = 0             # tokens of those results
    tokens: int = 0
    carried: int = 0
    restarted: int = 0
    dropped_groups: int = 0
    discarded_tokens: int = 0            # generated, then thrown away by restart / drop
    throttled: int = 0                   # fills cut short: no deadline free (stale_policy=finish)
    groups_emitted: int = 0
    groups_filtered: int = 0             # scored groups rollout.group_filter dropped (never trained)
    void_scores: int = 0                 # scores that landed after their samples were restarted / dropped
    refused: int = 0                     # samples whose request the engine refused as invalid (RequestError)
    groups_trained: int = 0              # groups the round handed to its step (elastic steps: a multiple of the target)
    due_wait_from: Optional[float] = None  # when the round had its groups but waited for due ones
    due_wait_samples: int = 0            # the due samples still generating when the wait began

    def occupancy(self, now: float, inflight: int, busy: int, counting: bool) -> None:
        """Integrate in-flight count and busy engines up to `now`; `counting`: the round is
        admitting (neither ending nor held), so the in-flight count is a floor candidate."""
        if self.last_t:
            dt = now - self.last_t
            self.inflight_area += dt * self.last_inflight
            self.busy_area += dt * self.last_busy
        self.last_t, self.last_inflight, self.last_busy = now, inflight, busy
        if counting and self.started:
            self.inflight_min = inflight if self.inflight_min is None else min(self.inflight_min, inflight)


def round_metrics(st: RoundStats, *, concurrency: int, engines: int, reprefill_extra: int,
                  requests_per_trained_sample: float) -> dict:
    """The round's own metrics (the controller adds what it holds: open and waiting groups)."""
    wall = max(st.ended - st.started, 1e-9)
    out = {"rollout_inflight_mean": st.inflight_area / wall, "rollout_concurrency": concurrency,
           "engine_busy_frac": st.busy_area / wall / max(1, engines),
           "rollout_requests": st.requests, "rollout_tokens": st.tokens,
           "rollout_requests_sent": st.sent, "reprefill_tokens": st.reprefill_tokens + reprefill_extra,
           "requests_per_trained_sample": requests_per_trained_sample,
           "requests_spanning_versions": st.spanning_requests, "tokens_of_spanning_requests": st.spanning_tokens,
           "aborted_inflight": st.carried, "restarted_samples": st.restarted,
           "dropped_groups": st.dropped_groups, "stale_tokens_discarded": st.discarded_tokens,
           "admission_throttled": st.throttled, "rollout_loop_lag_max_s": st.loop_lag_max,
           "groups_emitted": st.groups_emitted, "void_scores": st.void_scores,
           "refused_samples": st.refused, "groups_trained": st.groups_trained,
           # slot utilisation during the round: requests in flight over the concurrency
           "rollout_slots_used": st.inflight_area / wall / max(1, concurrency),
           "due_wait_s": 0.0 if st.due_wait_from is None else st.ended - st.due_wait_from,
           "due_wait_samples": st.due_wait_samples}
    out.update(filter_metrics(st.groups_filtered, st.groups_emitted + st.groups_filtered, st.groups_trained))
    if st.inflight_min is not None:   # absent when the round had its groups without generating
        out["rollout_inflight_min"] = st.inflight_min
    return out
