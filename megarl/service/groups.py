"""The groups of the agent service: each record of the run's data stream is handed out n
times (one episode per place), and a group is complete when its n episodes have a reward.
A cancelled or timed-out episode's place is handed out again before any new record, so every
group can complete. A complete group the run's group filter drops (`keep`, rollout.group_filter:
rollout/controller/group_filter.py) is never trained: it leaves the book, and the next episode
start draws a new record. Pure bookkeeping: no HTTP, no engine."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from megarl.data.sample import Sample
from megarl.rollout import routes as route_rows


@dataclass
class Group:
    """One record handed out n times, and the rewarded episodes of it so far (by slot)."""
    serial: int                    # the service's group number, from 0
    record: dict
    uid: int                       # the record's number in the run's data stream
    issued: int = 0                # slots handed out the first time
    free: list[int] = field(default_factory=list)   # slots to hand out again (cancelled, timed out, lost)
    samples: dict[int, Sample] = field(default_factory=dict)


class GroupBook:
    """Hands out records n times each and collects the groups their episodes fill."""

    def __init__(self, n: int, draw: Callable[[], tuple[dict, int]],
                 keep: Callable[[list[Sample]], bool] | None = None):
        self.n, self.draw = n, draw
        self.keep = keep    # the group filter: a complete group it says False to is dropped
        self.groups: dict[int, Group] = {}    # untaken groups, by serial (in serial order)
        self.next_serial = 0

    def hand_out(self) -> tuple[Group, int]:
        """(group, slot) for a new episode: a slot given back first (oldest group), else the
        next slot of the newest group, else a new record from the data stream."""
        for g in self.groups.values():
            if g.free:
                return g, g.free.pop(0)
        last = self.groups.get(self.next_serial - 1)
        if last is None or last.issued >= self.n:
            record, uid = self.draw()
            last = self.groups[self.next_serial] = Group(self.next_serial, record, uid)
            self.next_serial += 1
        last.issued += 1
        return last, last.issued - 1

    def give_back(self, group: Group, slot: int) -> None:
        group.free = sorted(group.free + [slot])

    def finish(self, group: Group, slot: int, sample: Sample) -> bool:
        """Record a rewarded episode; True when that completed its group (and the group filter
        kept it: a dropped group leaves the book, never trained)."""
        group.samples[slot] = sample
        if len(group.samples) < self.n:
            return False
        if self.keep is not None and not self.keep([group.samples[s] for s in sorted(group.samples)]):
            del self.groups[group.serial]
            return False
        return True

    def complete(self) -> list[Group]:
        return [g for g in self.groups.values() if len(g.samples) == self.n]

    def take(self, k: int) -> list[list[Sample]]:
        """The k oldest complete groups (each in slot order), removed; Sample.group is the
        group's position in the returned list (its index within the trainer's step)."""
        out = []
        for i, g in enumerate(self.complete()[:k]):
            del self.groups[g.serial]
            out.append([replace(g.samples[s], group=i) for s in sorted(g.samples)])
        return out

    def state_dict(self) -> dict:
        return {"next_serial": self.next_serial,
                "groups": [{"serial": g.serial, "record": g.record, "uid": g.uid, "issued": g.issued,
                            "samples": [[s, route_rows.sample_state(asdict(x))] for s, x in sorted(g.samples.items())]}
                           for g in self.groups.values()]}

    def load_state_dict(self, state: dict) -> int:
        """Restore; every slot handed out without a reward is handed out again (the episodes
        open at the snapshot are lost). Returns how many such slots there were."""
        self.next_serial, self.groups, lost = state["next_serial"], {}, 0
        for gs in state["groups"]:
            samples = {int(s): Sample(**route_rows.sample_from_state(x)) for s, x in gs["samples"]}
            free = [s for s in range(gs["issued"]) if s not in samples]
            lost += len(free)
            self.groups[gs["serial"]] = Group(gs["serial"], gs["record"], gs["uid"], gs["issued"], free, samples)
        return lost
