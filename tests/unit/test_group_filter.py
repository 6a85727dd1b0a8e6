"""rollout.group_filter (DAPO's dynamic sampling inside the controller) against scripted engines.

Reward pattern: a group of odd gid scores 1.0 on every sample (all equal: zero group-relative
advantage), an even one scores each sample's length (the scripted lengths differ within a
group). Under zero_variance no trained group is flat, each step still trains its groups,
concurrency stays fixed, a dropped group frees its deadline, the draw cap stops the run with
one line, and a checkpoint mid-round resumes without training a group twice or losing one.
"""
import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
from scripted_engine import Clock
from test_controller import KeyedEngine, trainer_logprob
from test_simulator import Linear

from megarl.config.errors import ConfigError
from megarl.config.schema.rollout import RolloutConfig
from megarl.data.sample import Sample
from megarl.rollout.controller import group_filter
from megarl.rollout.controller.group_filter import GroupFilterExhausted, build, fill_groups, zero_variance
from megarl.rollout.controller.partial import PartialRolloutController
from megarl.rollout.engines.pool import EnginePool
from megarl.service.groups import GroupBook
from megarl.sim.costs import MeasuredTrainer
from megarl.sim.run import SimSettings, simulate
from megarl.sim.workload import Workload, parse_dist


def reward(s: Sample) -> float:
    return 1.0 if s.uid % 2 else float(len(s.response_ids))


class Prompts:
    """A resumable prompt stream: its cursor is saved with the controller's state."""

    def __init__(self, drawn: int = 0):
        self.drawn = drawn

    def __call__(self):
        self.drawn += 1
        return {"q": self.drawn - 1}, [7, 7]


async def drive(rounds, filt, *, concurrency=8, target=3, max_staleness=8, policy="finish", state=None,
                start_version=0, update_mode="abort", between=None, score=reward, step_multiple=1, scorer=None):
    clock = Clock()
    clock.start()
    pool = EnginePool([KeyedEngine(f"e{i}", clock) for i in range(2)], 30, failures_max=1, update_mode=update_mode)
    prompts = Prompts(state["prompts"] if state else 0)
    ctl = PartialRolloutController(
        pool, n=4, concurrency=concurrency, max_new_tokens=64, temperature=1.0, max_staleness=max_staleness,
        stale_policy=policy, new_group=prompts, score=score, seed=0, group_filter=filt,
        step_multiple=step_multiple, scorer=scorer)
    ctl.prompts = prompts
    clock.is_pending = lambda: ctl._round_done is not None and not ctl._ending
    if state is not None:
        ctl.load_state_dict(state["controller"])
    version = start_version
    for e in pool.engines:
        e.version = version
    trained, metrics = [], []
    try:
        for _ in range(rounds):
            groups = await ctl.run_round(target, version)
            ctl.take_ready()
            trained.append((version, groups))
            metrics.append(ctl.metrics())
            for slot, restarts, length, _sample in ctl.pending_old_logprobs():
                ctl.store_old_logprobs(slot, restarts, length, [trainer_logprob(version, p) for p in range(length)])
            version += 1
            await pool.reload_weights("/nowhere", version)
            if between:
                await between(ctl, version)
    finally:
        clock.stop()
    return ctl, trained, metrics, clock


def flat(group) -> bool:
    return len(set(group.rewards)) == 1


def test_zero_variance_trains_no_flat_group_and_keeps_steps_and_concurrency():
    filt = build("zero_variance", 10)
    ctl, trained, metrics, clock = asyncio.run(drive(5, filt))
    groups = [g for _, gs in trained for g in gs]
    assert all(len(gs) == 3 for _, gs in trained)       # train.groups_per_step groups every step
    assert not any(flat(g) for g in groups)
    assert all(g.gid % 2 == 0 for g in groups)
    dropped = sum(m["groups_filtered"] for m in metrics)
    assert dropped > 0 and filt.filtered_total >= dropped
    assert all(0 <= m["filtered_frac"] <= 1 for m in metrics)
    assert any(m["prompts_drawn_per_trained_group"] > 1 for m in metrics)
    # concurrency stays fixed: a dropped group's place is taken by the next prompt at once
    ticks = [c for c, pending in zip(clock.running_total, clock.pending) if pending]
    assert ticks and ticks.count(8) == len(ticks), sorted(set(ticks))
    # without the filter the same stream trains flat groups (the test's pattern has them)
    _, plain, _, _ = asyncio.run(drive(5, build("none")))
    assert any(flat(g) for _, gs in plain for g in gs)


@pytest.mark.parametrize("step_multiple", [1, 2])
def test_a_dropped_due_group_does_not_hold_the_round(step_multiple):
    """max_staleness=0: every group is due at the step it opens in, and admission waits once a
    step's room is taken. Scored off the loop (the verifier's thread), a dropped group must free
    its room and deadline and admission open the next prompt, or the round never ends (the
    wait_for: a hang, not a timing; the run takes about a second)."""
    filt = build("zero_variance", 10)
    with ThreadPoolExecutor(max_workers=1) as scorer:
        ctl, trained, metrics, _ = asyncio.run(asyncio.wait_for(
            drive(4, filt, max_staleness=0, step_multiple=step_multiple, scorer=scorer), 120))
    assert all(len(gs) in (3, 6) and not any(flat(g) for g in gs) for _, gs in trained)
    assert sum(m["groups_filtered"] for m in metrics) > 0
    untrained = [*ctl.groups.values(), *ctl.completed]
    assert all(g.gid % 2 == 0 or not g.complete for g in untrained)


def test_the_draw_cap_stops_the_run_with_one_line():
    filt = build("zero_variance", 2)
    with pytest.raises(GroupFilterExhausted) as err:
        asyncio.run(drive(3, filt, score=lambda s: 0.0))   # every group flat: the task is "solved"
    msg = str(err.value)
    assert "\n" not in msg and "rollout.group_filter_max_draws=2" in msg and "step 0" in msg
    assert filt.filtered_total == (2 - 1) * 3 + 1


def test_checkpoint_mid_round_resumes_without_training_a_group_twice_or_losing_one():
    judged = []   # (gid, kept) in the order the filter saw them

    def recording(samples):
        judged.append((samples[0].uid, zero_variance(samples)))
        return judged[-1][1]
    saved = {}

    async def snapshot(ctl, version):
        for _ in range(3):
            await ctl.pool.engines[0].clock.tick()
        if version == 2:
            await ctl.hold(scoring=True)
            saved["state"] = {"controller": copy.deepcopy(ctl.state_dict()), "prompts": ctl.prompts.drawn}
            saved["mark"] = len(judged)
            ctl.release()

    first, part1, _, _ = asyncio.run(drive(4, group_filter.GroupFilter("mine", recording), update_mode="keep",
                                           between=snapshot))
    state = saved["state"]
    assert state["controller"]["filter"]["filtered_total"] == sum(not k for _, k in judged[:saved["mark"]])
    part1 = [(v, gs) for v, gs in part1 if v < 2]       # the run killed after the snapshot
    seen = judged[:saved["mark"]]
    judged.clear()
    filt = group_filter.GroupFilter("mine", recording)
    last, part2, _, _ = asyncio.run(drive(3, filt, state=state, start_version=2, update_mode="keep"))
    seen += judged
    trained = [g.gid for _, gs in part1 + part2 for g in gs]
    dropped = [gid for gid, keep in seen if not keep]
    assert len(trained) == len(set(trained)) == 15
    assert len(dropped) == len(set(dropped)) and not set(dropped) & set(trained)
    assert filt.filtered_total == len(dropped)         # the count survived the checkpoint
    waiting = {g.gid for g in [*last.groups.values(), *last.completed]}
    # every prompt drawn is trained, dropped or still waiting: none lost, none drawn twice
    assert set(trained) | set(dropped) | waiting == set(range(last.next_gid)) == set(range(last.prompts.drawn))


def _group(uid: int, rewards: list[float]) -> list[Sample]:
    return [Sample([1], [2], [0.0], [0], True, 0, {}, reward=r, uid=uid) for r in rewards]


def test_sync_mode_draws_replacements_until_the_step_has_its_groups():
    stream = iter(range(100))

    def draw(count, k):
        out = []
        for _ in range(count):
            uid = next(stream)
            out.append(_group(uid, [1.0, 1.0] if uid % 3 else [0.0, 1.0]))
        return out
    groups, metrics = fill_groups(draw, 4, build("zero_variance", 10), step=0)
    assert len(groups) == 4 and not any(len({s.reward for s in g}) == 1 for g in groups)
    assert [s.group for g in groups for s in g] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert metrics["groups_filtered"] == 2 * 4 - 0 - 2 and metrics["prompts_drawn_per_trained_group"] > 1
    # no filter: one draw, exactly the step
    groups, metrics = fill_groups(draw, 4, build("none"), step=1)
    assert len(groups) == 4 and metrics["groups_filtered"] == 0
    with pytest.raises(GroupFilterExhausted, match="rollout.group_filter_max_draws=3"):
        fill_groups(lambda count, k: [_group(0, [1.0, 1.0])] * count, 2, build("zero_variance", 3), step=5)


def test_an_import_path_filter_runs_in_the_controller(tmp_path, monkeypatch):
    (tmp_path / "myfilters.py").write_text("def long_enough(samples):\n"
                                           "    return sum(len(s.response_ids) for s in samples) > 20\n")
    path = f"{tmp_path / 'myfilters.py'}:long_enough"
    assert RolloutConfig(group_filter=path).group_filter == path
    filt = build(path, 10)
    _, trained, metrics, _ = asyncio.run(drive(3, filt))
    assert all(sum(len(s.response_ids) for s in g.slots) > 20 for _, gs in trained for g in gs)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build("myfilters:long_enough").active


def test_zero_advantage_share_of_trained_groups():
    samples = _group(0, [1.0, 1.0]) + _group(1, [0.0, 1.0])
    assert group_filter.zero_advantage_frac(samples) == 0.5


@pytest.mark.parametrize("kwargs, fragment", [
    ({"group_filter": "zero_varience"}, "rollout.group_filter='zero_varience': unknown group filter"),
    ({"group_filter": "no_such_module_here:fn"}, "no module named 'no_such_module_here'"),
    ({"group_filter": "megarl.rollout.controller.group_filter:KEY"}, "not a function"),
    ({"group_filter_max_draws": 0}, "rollout.group_filter_max_draws=0: must be >= 1"),
])
def test_bad_settings_are_one_line_each(kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        RolloutConfig(**kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_bad_filter_objects_are_one_line_each():
    with pytest.raises(ValueError, match="rollout.group_filter_max_draws=0"):
        build("zero_variance", 0)
    filt = group_filter.GroupFilter("mine", lambda samples: 1)
    with pytest.raises(TypeError, match="returns True .* or False"):
        filt.judge(_group(0, [1.0]))


def test_the_service_drops_a_filtered_group_and_draws_a_new_record():
    records = iter(range(10))
    book = GroupBook(2, lambda: ({"r": (r := next(records))}, r), keep=build("zero_variance").judge)
    group, slot = book.hand_out()
    book.hand_out()
    assert not book.finish(group, 0, _group(0, [1.0])[0]) and not book.finish(group, 1, _group(0, [1.0])[0])
    assert group.serial not in book.groups and book.state_dict()["groups"] == []   # never trained, not saved
    group, _ = book.hand_out()
    assert group.uid == 1                                                           # the next record
    book.hand_out()
    book.finish(group, 0, _group(1, [0.0])[0])
    assert book.finish(group, 1, _group(1, [1.0])[0]) and len(book.take(1)) == 1


@pytest.mark.parametrize("mode", ["sync", "partial", "async"])
def test_the_simulator_models_the_rollout_filtering_costs(mode):
    def run(rate):
        s = SimSettings(mode=mode, steps=4, groups_per_step=2, concurrency=8, filter_rate=rate, max_staleness=2,
                        max_step_multiple=1)
        w = Workload(parse_dist("fixed:len=10"), n=2, max_len=64, prompt_len=lambda g: 4)
        return simulate(s, w, Linear(a=0.01), MeasuredTrainer(0.5, 0.0, push_s=0.1))
    plain, filtered = run(0.0), run(0.5)
    assert plain["groups_filtered"] == 0 and filtered["groups_filtered"] > 0
    assert filtered["trained_samples"] == plain["trained_samples"]
    assert filtered["generated_tokens"] > plain["generated_tokens"]
    with pytest.raises(ValueError, match="filter_rate=1"):
        SimSettings(filter_rate=1.0)
