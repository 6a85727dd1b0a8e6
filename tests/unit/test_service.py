"""The agent service (megarl/service/) over real HTTP: the openai client from this thread, the
service and a table engine (tests/unit/service_support.py) on a LoopThread, as the trainer runs
them. Expected token ids are written out from the support module's vocabulary and template."""
import threading
import time

import httpx
import openai
import pytest
from service_support import (
    ASSISTANT,
    BOS,
    EOS,
    NL,
    SYSTEM,
    USER,
    ServiceHarness,
    TableEngine,
    build_tokenizer,
    harnesses,
    ids,
    reply_logprob,
)

from megarl.service import AgentService
from megarl.service.service import GroupBook

KEY = "test-key-1234"
T = 0.7
FIRST = [{"role": "system", "content": "hello world"}, {"role": "user", "content": "what next"}]
PROMPT = [BOS, SYSTEM] + ids("hello world") + [EOS, NL, USER] + ids("what next") + [EOS, NL, ASSISTANT]
REPLY0, REPLY1 = ids("the answer is four") + [EOS], ids("try again five") + [EOS]
# "try again" as a user message after a turn that ended on <eos>: the <nl> the engine never
# produced, then the message, then the assistant turn opened
DELTA = [NL, USER] + ids("try again") + [EOS, NL, ASSISTANT]


def second(first_content: str = "the answer is four") -> list[dict]:
    return FIRST + [{"role": "assistant", "content": first_content}, {"role": "user", "content": "try again"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class Harness(ServiceHarness):
    """Engine, pool and service on a loop thread; an openai client against the service."""

    def __init__(self, tokenizer, update_mode: str = "abort", **settings):
        super().__init__(tokenizer, TableEngine(), "test-agent-service",
                         dict(update_mode=update_mode, keep_kv=False), **{"api_key": KEY, "temperature": T, **settings})
        self.client = self.connect(KEY)

    def connect(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.service.url + "/v1", api_key=key, max_retries=0, timeout=10,
                             http_client=httpx.Client(trust_env=False))

    def call(self, fn, *args):
        """A plain function of the service, run on its loop (no race with the handlers)."""
        async def run():
            return fn(*args)
        return self.loop.run(run(), 10)

    def open(self) -> dict:
        return self.client.post("/episodes", body={}, cast_to=object)

    def chat(self, eid: str, messages: list[dict], **kw):
        return self.client.chat.completions.create(model="megarl-policy", messages=messages,
                                                   extra_body={"episode_id": eid}, **kw)

    def reward(self, eid: str, reward: float) -> dict:
        return self.client.post(f"/episodes/{eid}/reward", body={"reward": reward}, cast_to=object)



@pytest.fixture
def make(tokenizer):
    yield from harnesses(Harness, tokenizer)


def test_the_key_is_checked_on_every_route_but_health(make):
    h = make()
    with pytest.raises(openai.AuthenticationError):
        h.connect("wrong-key").models.list()
    with pytest.raises(openai.AuthenticationError):       # no Authorization header at all
        h.client.chat.completions.create(model="m", messages=FIRST, extra_body={"episode_id": "x"},
                                         extra_headers={"Authorization": openai.Omit()})
    raw = httpx.Client(trust_env=False, timeout=10)
    refused = raw.post(h.service.url + "/v1/episodes")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert raw.get(h.service.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in h.client.models.list()] == ["megarl-policy"]
    assert h.service.metrics()["agent_episodes_started"] == 0


def test_a_group_of_two_episodes_comes_out_token_exact(make):
    h = make()
    a, b = h.open(), h.open()
    assert (a["group"], a["index"], b["group"], b["index"]) == (0, 0, 0, 1)
    assert a["task"] == b["task"] == {"prompt": "task 0"}
    for ep in (a, b):
        first = h.chat(ep["episode_id"], FIRST, logprobs=True)
        assert first.choices[0].message.content == "the answer is four"
        assert first.choices[0].finish_reason == "stop"
        assert [c.logprob for c in first.choices[0].logprobs.content] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
        assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (len(PROMPT), 5)
        # the second call names the episode in a header this time
        again = h.client.chat.completions.create(model="megarl-policy", messages=second(),
                                                 extra_headers={"X-Episode-Id": ep["episode_id"]})
        assert again.choices[0].message.content == "try again five"
    traj = h.client.get(f"/episodes/{a['episode_id']}", cast_to=object)
    assert traj["state"] == "open" and traj["response_ids"] == REPLY0 + DELTA + REPLY1
    h.reward(a["episode_id"], 1.0)
    assert h.call(h.service.metrics)["agent_groups_ready"] == 0
    assert h.reward(b["episode_id"], 0.25)["group_complete"] is True

    [group] = h.loop.run(h.service.take_groups(1), 10)
    assert [s.reward for s in group] == [1.0, 0.25]
    for s in group:
        assert s.prompt_ids == PROMPT
        assert s.response_ids == REPLY0 + DELTA + REPLY1
        assert s.mask == [1] * 5 + [0] * 7 + [1] * 4
        assert s.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5] + [0.0] * 7 + [-0.11, -0.21, -0.31, -0.41])
        assert s.versions == [0] * 16
        assert (s.turns, s.stopped, s.finish_reason, s.group, s.uid) == (2, True, "stop", 0, 100)
        assert s.record == {"prompt": "task 0"}
    # token-exact: every call's prompt was the episode's ids so far, nothing re-tokenized
    sent = [p for _, p, _ in h.engine.log]
    assert sent == [PROMPT, PROMPT + REPLY0 + DELTA] * 2
    m = h.call(h.service.metrics)
    assert (m["agent_episodes_finished"], m["agent_calls"], m["agent_turns_per_episode"]) == (2, 4, 2.0)
    assert (m["agent_observation_tokens"], m["agent_open_episodes"], m["agent_groups_ready"]) == (14, 0, 0)
    assert h.open()["group"] == 1 and h.drawn == 2


def test_a_rewritten_history_is_refused_and_leaves_the_episode_as_it_was(make):
    h = make()
    eid = h.open()["episode_id"]
    h.chat(eid, FIRST)
    with pytest.raises(openai.ConflictError) as err:
        h.chat(eid, second("the answer is five"))
    assert eid in err.value.message and "messages[2]" in err.value.message
    assert err.value.body["type"] == "conflict_error"
    with pytest.raises(openai.ConflictError, match="at least one new message"):
        h.chat(eid, FIRST + [{"role": "assistant", "content": "the answer is four"}])
    with pytest.raises(openai.ConflictError, match=r"messages\[0\]"):
        h.chat(eid, [{"role": "system", "content": "hello"}] + second()[1:])
    # the refused calls recorded nothing: the right one still appends exactly the delta
    assert h.chat(eid, second()).choices[0].message.content == "try again five"
    traj = h.client.get(f"/episodes/{eid}", cast_to=object)
    assert traj["response_ids"] == REPLY0 + DELTA + REPLY1 and traj["turns"] == 2
    assert len(h.engine.log) == 2


def test_sampling_options_other_than_the_runs_are_refused(make):
    h = make()
    eid = h.open()["episode_id"]
    with pytest.raises(openai.BadRequestError, match="temperature=1.0 differs from the run's temperature 0.7"):
        h.chat(eid, FIRST, temperature=1.0)
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        h.chat(eid, FIRST, stream=True)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        h.chat(eid, FIRST, n=2)
    with pytest.raises(openai.BadRequestError, match="top_p=0.9"):
        h.chat(eid, FIRST, top_p=0.9)
    with pytest.raises(openai.BadRequestError, match="no episode"):
        h.client.chat.completions.create(model="megarl-policy", messages=FIRST)
    with pytest.raises(openai.NotFoundError, match="no episode 'ep-nope'"):
        h.chat("ep-nope", FIRST)
    assert h.engine.log == []
    assert h.chat(eid, FIRST, temperature=T).choices[0].message.content == "the answer is four"


def test_open_episodes_are_capped(make):
    h = make(max_episodes=2)
    first, _ = h.open(), h.open()
    with pytest.raises(openai.RateLimitError, match="service.max_episodes=2"):
        h.open()
    h.client.post(f"/episodes/{first['episode_id']}/cancel", body={}, cast_to=object)
    again = h.open()
    # the cancelled episode's place in group 0 is handed out again
    assert (again["group"], again["index"]) == (0, 0)
    assert h.call(h.service.metrics)["agent_episodes_cancelled"] == 1


def test_an_idle_episode_times_out_and_its_place_is_handed_out_again(make):
    h = make(episode_timeout_s=0.2)
    eid = h.open()["episode_id"]
    time.sleep(0.8)
    m = h.call(h.service.metrics)
    assert (m["agent_episodes_timed_out"], m["agent_open_episodes"]) == (1, 0)
    with pytest.raises(openai.ConflictError, match="service.episode_timeout_s=0.2"):
        h.chat(eid, FIRST)
    again = h.open()
    assert (again["group"], again["index"], again["task"]) == (0, 0, {"prompt": "task 0"})


def test_the_token_budget_cuts_the_last_call_then_refuses(make):
    h = make(max_new_tokens=14)        # 5 (first reply) + 7 (delta) leaves 2
    eid = h.open()["episode_id"]
    h.chat(eid, FIRST)
    cut = h.chat(eid, second())
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("try again", "length")
    assert h.engine.log[-1][2] == 2
    with pytest.raises(openai.BadRequestError, match="episode token budget spent"):
        h.chat(eid, second() + [{"role": "assistant", "content": "try again"}, {"role": "user", "content": "ok"}])
    traj = h.client.get(f"/episodes/{eid}", cast_to=object)
    assert traj["response_ids"] == REPLY0 + DELTA + ids("try again")
    assert traj["mask"] == [1] * 5 + [0] * 7 + [1] * 2 and traj["finish_reason"] == "length"


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_a_weight_update_mid_call_keeps_every_token_and_its_version(make, mode):
    h = make(update_mode=mode)
    eid = h.open()["episode_id"]
    h.engine.stall_after = 2
    answer = {}
    worker = threading.Thread(target=lambda: answer.update(r=h.chat(eid, FIRST)))
    worker.start()
    assert h.engine.stalled.wait(10)    # two tokens produced under version 0, the call in flight
    h.loop.run(h.pool.begin_update(), 10)   # abort: the request is aborted; keep: held by the pause
    h.engine.unstall(h.loop.loop)           # (paused now: nothing more before the new weights)
    h.loop.run(h.engine.reload_weights("unused", 1), 10)
    h.loop.run(h.pool.end_update(), 10)
    worker.join(10)
    assert answer["r"].choices[0].message.content == "the answer is four"
    traj = h.client.get(f"/episodes/{eid}", cast_to=object)
    assert traj["response_ids"] == REPLY0
    assert traj["logprobs"] == pytest.approx([reply_logprob(0, j) for j in range(5)])
    assert traj["versions"] == [0, 0, 1, 1, 1]
    if mode == "abort":
        # aborted after two tokens, sent again with them appended after the update
        assert [p for _, p, _ in h.engine.log] == [PROMPT, PROMPT + REPLY0[:2]]
        assert h.call(h.service.metrics)["agent_continuations"] == 1
    else:
        # one request, held over the update (its KV dropped: rollout.keep_kv=false)
        assert [p for _, p, _ in h.engine.log] == [PROMPT] and h.engine.kv_cleared == 1
        assert h.call(h.service.metrics)["agent_continuations"] == 0


def test_reward_needs_a_call_and_a_number(make):
    h = make()
    eid = h.open()["episode_id"]
    with pytest.raises(openai.ConflictError, match="no model call"):
        h.reward(eid, 1.0)
    h.chat(eid, FIRST)
    with pytest.raises(openai.BadRequestError, match="finite number"):
        h.client.post(f"/episodes/{eid}/reward", body={"reward": "high"}, cast_to=object)
    h.reward(eid, 1.0)
    with pytest.raises(openai.ConflictError, match="has ended"):
        h.chat(eid, second())


def test_state_keeps_untaken_groups_and_hands_out_the_lost_places_again(make):
    h = make()
    for _ in range(2):                      # group 0 complete
        eid = h.open()["episode_id"]
        h.chat(eid, FIRST)
        h.reward(eid, 1.0)
    done = h.open()["episode_id"]           # group 1: one rewarded, one open (lost)
    h.open()
    h.chat(done, FIRST)
    h.reward(done, 0.5)
    state = h.call(h.service.state_dict)
    assert state["open_episodes"] == 1

    fresh = make()
    fresh.call(fresh.service.load_state_dict, state)
    assert fresh.call(fresh.service.metrics)["agent_episodes_lost"] == 1
    [group] = fresh.loop.run(fresh.service.take_groups(1), 10)
    assert [s.reward for s in group] == [1.0, 1.0] and group[0].response_ids == REPLY0
    again = fresh.open()
    assert (again["group"], again["index"], again["task"]) == (1, 1, {"prompt": "task 1"})
    fresh.chat(again["episode_id"], FIRST)
    fresh.reward(again["episode_id"], 0.0)
    [group] = fresh.loop.run(fresh.service.take_groups(1), 10)
    assert [(s.reward, s.uid, s.group) for s in group] == [(0.5, 101, 0), (0.0, 101, 0)]
    assert fresh.open()["group"] == 2 and fresh.drawn == 1


def test_the_group_book_hands_out_given_back_places_first():
    drawn = iter([({"q": "a"}, 7), ({"q": "b"}, 8)])
    book = GroupBook(3, lambda: next(drawn))
    got = [book.hand_out() for _ in range(4)]
    assert [(g.serial, s) for g, s in got] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    book.give_back(got[1][0], 1)
    g, s = book.hand_out()
    assert (g.serial, g.uid, s) == (0, 7, 1)
    assert (book.hand_out()[1], book.next_serial) == (1, 2)


def test_settings_are_checked_by_name(tokenizer):
    task = lambda: ({}, 0)
    with pytest.raises(ValueError, match="service.api_key"):
        AgentService(None, tokenizer, next_task=task, max_model_len=256, n=2, api_key="")
    with pytest.raises(ValueError, match="rollout.sampling.temperature=0"):
        AgentService(None, tokenizer, next_task=task, max_model_len=256, n=2, api_key=KEY, temperature=0)
    with pytest.raises(ValueError, match="rollout.sampling.n=0"):
        AgentService(None, tokenizer, next_task=task, max_model_len=256, n=0, api_key=KEY)
