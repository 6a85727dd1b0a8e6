"""What the agent service answers when a call cannot be served, and the bounds on what agents
can make it hold (real HTTP against the service on a LoopThread, table engines of
tests/unit/service_support.py).

- a call the engine refuses as invalid is a 400 with the engine's message; the engine stays in
  service and the episode is unchanged;
- an engine failure is a 503 that names no engine URL or log path (nor does any other error);
- the first call's prompt, and every later call's, must fit the engines' context
  (rollout.engines.max_model_len): refused with a 400 before any engine call, and a call's
  completion is cut to what the context holds;
- request bodies are bounded (service.max_request_mb: 413), and so are the complete groups
  waiting for the trainer (service.max_ready_groups: new episodes get 429 until a step takes some).
"""
import httpx
import pytest
from service_support import EOS, ServiceHarness, TableEngine, build_tokenizer, harnesses, ids

from megarl.rollout.engines.engine import EngineError, RequestError

KEY = "test-key-1234"
FIRST = [{"role": "system", "content": "hello world"}, {"role": "user", "content": "what next"}]
PROMPT_LEN = 12     # FIRST rendered: <bos> <system> hello world <eos> <nl> <user> what next <eos> <nl> <assistant>
REPLY0 = ids("the answer is four") + [EOS]
SECRET_URL, SECRET_LOG = "http://10.1.2.3:8000", "/var/log/megarl/engine_0.log"


def second(user: str) -> list[dict]:
    return FIRST + [{"role": "assistant", "content": "the answer is four"}, {"role": "user", "content": user}]


class Refusing(TableEngine):
    """Refuses (as vLLM refuses a prompt longer than its max_model_len) any prompt holding the
    word "six"; fails like a dead server once `broken` is set."""

    broken = False

    async def generate(self, req):
        if self.broken:
            raise EngineError(f"engine {self.name} ({SECRET_URL}, log {SECRET_LOG}): connection lost during "
                              f"request {req.key}")
        if ids("six")[0] in req.prompt_ids:
            raise RequestError(f"engine {self.name} refused request {req.key}: The decoder prompt (length "
                               f"{len(req.prompt_ids)}) is longer than the maximum model length of 8.", req.key)
        return await super().generate(req)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


class Harness(ServiceHarness):
    """A `Refusing` engine; an httpx client against the service."""

    def __init__(self, tokenizer, **settings):
        super().__init__(tokenizer, Refusing(), "test-service-limits", dict(failures_max=0),
                         **{"api_key": KEY, "temperature": 1.0, **settings})
        self.http = httpx.Client(base_url=self.service.url + "/v1", trust_env=False, timeout=10,
                                 headers={"Authorization": f"Bearer {KEY}"})

    def open(self) -> httpx.Response:
        return self.http.post("/episodes")

    def chat(self, eid: str, messages, **kw) -> httpx.Response:
        return self.http.post("/chat/completions", json={"model": "m", "messages": messages, "episode_id": eid, **kw})


@pytest.fixture
def make(tokenizer):
    yield from harnesses(Harness, tokenizer)


def _error(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


def test_a_refused_call_is_a_400_with_the_engines_message_and_the_episode_goes_on(make):
    h = make()
    eid = h.open().json()["episode_id"]
    assert h.chat(eid, FIRST).status_code == 200
    before = h.http.get(f"/episodes/{eid}").json()
    refused = h.chat(eid, second("six"))
    assert refused.status_code == 400, refused.text
    assert "maximum model length" in _error(refused) and refused.json()["error"]["type"] == "invalid_request_error"
    assert h.http.get(f"/episodes/{eid}").json() == before          # nothing recorded
    assert h.pool.failures == [] and h.pool.engines == [h.engine]   # the engine stays in service
    ok = h.chat(eid, second("try again"))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "try again five"


def test_an_engine_failure_is_a_503_naming_no_engine_url_or_log(make):
    h = make()
    eid = h.open().json()["episode_id"]
    h.engine.broken = True
    failed = h.chat(eid, FIRST)
    assert failed.status_code == 503, failed.text
    assert SECRET_URL not in failed.text and SECRET_LOG not in failed.text and "10.1.2.3" not in failed.text
    assert "may be sent again" in _error(failed)
    # a route that meets the dead pool elsewhere, and an unexpected error: the same rule
    gone = h.http.post(f"/episodes/{h.open().json()['episode_id']}/cancel")
    assert SECRET_URL not in gone.text and SECRET_LOG not in gone.text

    def broken_trajectory(episode_id):
        raise RuntimeError(f"unexpected, see {SECRET_LOG}")
    h.service.trajectory = broken_trajectory
    internal = h.http.get(f"/episodes/{eid}")
    assert internal.status_code == 500 and SECRET_LOG not in internal.text


def test_the_first_calls_prompt_must_fit_the_engines_context(make):
    h = make(max_model_len=PROMPT_LEN)
    eid = h.open().json()["episode_id"]
    refused = h.chat(eid, FIRST)
    assert refused.status_code == 400, refused.text
    assert "rollout.engines.max_model_len=12" in _error(refused) and "12 tokens" in _error(refused)
    assert h.engine.log == [], "the engine was asked anyway"


def test_a_call_is_cut_to_the_context_and_later_calls_must_fit_it(make):
    h = make(max_model_len=PROMPT_LEN + 3)
    eid = h.open().json()["episode_id"]
    cut = h.chat(eid, FIRST)
    assert cut.status_code == 200
    assert (cut.json()["choices"][0]["message"]["content"], cut.json()["choices"][0]["finish_reason"]) == \
        ("the answer is", "length")
    assert h.engine.log[-1][2] == 3
    full = h.chat(eid, FIRST + [{"role": "assistant", "content": "the answer is"},
                                {"role": "user", "content": "try again"}])
    assert full.status_code == 400 and "rollout.engines.max_model_len=15" in _error(full)
    assert len(h.engine.log) == 1


def test_request_bodies_are_bounded(make):
    h = make(max_request_bytes=4096)
    eid = h.open().json()["episode_id"]
    big = [{"role": "user", "content": "hello " * 2000}]
    declared = h.chat(eid, big)
    assert declared.status_code == 413 and "service.max_request_mb" in _error(declared)

    def chunks():                       # no Content-Length: the service counts what arrives
        yield b'{"model": "m", "episode_id": "' + eid.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"hello " * 20
        yield b'"}]}'
    streamed = h.http.post("/chat/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413 and "service.max_request_mb" in _error(streamed)
    assert h.engine.log == []
    assert h.chat(eid, FIRST).status_code == 200          # a normal call still goes through


def test_complete_groups_waiting_for_the_trainer_are_bounded(make):
    h = make(max_ready_groups=1)
    for _ in range(2):                   # group 0 complete, not taken
        eid = h.open().json()["episode_id"]
        assert h.chat(eid, FIRST).status_code == 200
        assert h.http.post(f"/episodes/{eid}/reward", json={"reward": 1.0}).status_code == 200
    full = h.open()
    assert full.status_code == 429 and "service.max_ready_groups=1" in _error(full)
    [group] = h.loop.run(h.service.take_groups(1), 10)
    assert len(group) == 2
    assert h.open().status_code == 200
    with pytest.raises(ValueError, match=r"service.max_ready_groups=1"):
        h.loop.run(h.service.take_groups(2), 10)
