"""Routing replay through the agent service (megarl/service/): an episode's sample carries the
experts each of its tokens was routed to, as megarl's own episodes do: each token's row from the
call (or the continuation after an abort) that first fed it to the engine, the observation
tokens' from the next call, and the rows survive the service's state (a checkpoint)."""
import io
import threading

import numpy as np
import pytest
import torch
from service_support import ServiceHarness, TableEngine, build_tokenizer, harnesses, reply_ids

FIRST = [{"role": "system", "content": "hello world"}, {"role": "user", "content": "what next"}]
SECOND = FIRST + [{"role": "assistant", "content": "the answer is four"}, {"role": "user", "content": "try again"}]


class RoutedEngine(TableEngine):
    """The table engine reporting routes of one MoE layer, top-2: row i of a request is
    [its input token i, the request's number], so the test sees which request each row came from."""

    def __init__(self):
        super().__init__("routed0")
        self.requests = 0

    async def generate(self, req):
        number, self.requests = self.requests, self.requests + 1
        res = await super().generate(req)
        fed = list(req.prompt_ids) + res.token_ids
        res.routes = np.array([[[t, number]] for t in fed[:-1]], dtype=np.uint8)
        return res


class Harness(ServiceHarness):
    def __init__(self, tokenizer, update_mode: str = "abort"):
        super().__init__(tokenizer, RoutedEngine(), "test-service-routes", dict(update_mode=update_mode, keep_kv=False),
                         n=1, api_key="test-key-1234", temperature=0.7)

    def on_loop(self, fn, *args):
        async def run():
            return fn(*args)
        return self.loop.run(run(), 10)

    def chat(self, eid: str, messages):
        return self.loop.run(self.service.chat(eid, messages), 10)

    def finish(self, eid: str):
        self.loop.run(self.service.reward(eid, 1.0), 10)
        [[sample]] = self.loop.run(self.service.take_groups(1), 10)
        return sample


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def make(tokenizer):
    yield from harnesses(Harness, tokenizer)


def first_request(sample) -> list[int]:
    """The request each row came from (the rows' second column)."""
    return sample.routes[:, 0, 1].tolist()


def test_a_two_call_episode_keeps_each_tokens_first_route(make):
    h = make()
    eid = h.on_loop(h.service.open_episode)["episode_id"]
    h.chat(eid, FIRST)
    h.chat(eid, SECOND)
    s = h.finish(eid)
    seq = s.prompt_ids + s.response_ids
    assert s.routes.shape == (len(seq) - 1, 1, 2) and s.routes.dtype == np.uint8
    assert s.routes[:, 0, 0].tolist() == seq[:-1]     # row i is token i's
    # the first call fed the prompt and its completion but the last token; the second call
    # fed that token, the new messages (context, mask 0) and its own completion
    fed_first = len(s.prompt_ids) + len(reply_ids(0)) - 1
    assert first_request(s) == [0] * fed_first + [1] * (len(seq) - 1 - fed_first)
    assert s.mask.count(0) > 0   # the context rows are among the second call's


def test_a_call_sent_again_after_an_abort_keeps_the_rows_it_had(make):
    h = make(update_mode="abort")
    eid = h.on_loop(h.service.open_episode)["episode_id"]
    h.engine.stall_after = 2
    worker = threading.Thread(target=lambda: h.chat(eid, FIRST))
    worker.start()
    assert h.engine.stalled.wait(10)           # two tokens under version 0, the call in flight
    h.loop.run(h.pool.begin_update(), 10)      # aborted
    h.engine.unstall(h.loop.loop)
    h.loop.run(h.engine.reload_weights("unused", 1), 10)
    h.loop.run(h.pool.end_update(), 10)
    worker.join(10)
    s = h.finish(eid)
    assert h.engine.requests == 2 and s.response_ids == reply_ids(0)
    seq = s.prompt_ids + s.response_ids
    assert s.routes[:, 0, 0].tolist() == seq[:-1]
    # the aborted request fed the prompt and its first token; the continuation the rest
    fed_first = len(s.prompt_ids) + 2 - 1
    assert first_request(s) == [0] * fed_first + [1] * (len(seq) - 1 - fed_first)


def test_routes_survive_the_service_state(make):
    h = make()
    eid = h.on_loop(h.service.open_episode)["episode_id"]
    h.chat(eid, FIRST)
    h.loop.run(h.service.reward(eid, 1.0), 10)
    state = h.on_loop(h.service.state_dict)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)   # as checkpoints are read: no numpy arrays inside
    fresh = make()
    fresh.on_loop(fresh.service.load_state_dict, state)
    [[s]] = fresh.loop.run(fresh.service.take_groups(1), 10)
    seq = s.prompt_ids + s.response_ids
    assert isinstance(s.routes, np.ndarray) and s.routes[:, 0, 0].tolist() == seq[:-1]
    assert first_request(s) == [0] * (len(seq) - 1)
