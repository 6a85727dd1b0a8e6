"""The engine side of a staged update (weight_sync.staged): megarl's gloo backend as a vLLM
worker runs it, over a real gloo weight group, with a stand-in for the worker's model (its
`load_weights` records what it is given) and vLLM's layerwise-reload hooks recorded.

The contract: a staged bucket's `update_weights` returns before any byte arrives (the worker's
thread goes back to generating); nothing touches the model until the finish, which loads every
staged bucket inside one layerwise reload; a receive that failed loads nothing; a session the
sender gave up on (a new group) is discarded by the next finish (vLLM's stale session)."""
import threading
import types

import pytest
import torch

from megarl.distributed.env import free_port
from megarl.rollout.weights import gloo_backend, group, packing, wires
from megarl.rollout.weights.staging import StagingError

TIMEOUT_S = 10.0
BUCKETS = [[(f"layers.{b}.{k}", torch.arange(b * 100 + k * 10, b * 100 + k * 10 + 12,
                                             dtype=torch.float32).view(3, 4)) for k in range(2)]
           for b in range(3)]


class Model:
    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}
        self.events: list[str] = []

    def load_weights(self, weights):
        self.events.append("load")
        self.loaded.update({n: t.clone() for n, t in weights})


@pytest.fixture
def reload_hooks(monkeypatch):
    from vllm.model_executor.model_loader import reload
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: model.events.append("init"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, cfg: model.events.append("final"))


class Session:
    """A sender (rank 0, its own thread) and one staged worker (rank 1) in a new group."""

    def __init__(self, engine=None):
        port, token = free_port(), group.new_token()
        self.store = group.store("127.0.0.1", port, 2, TIMEOUT_S, sender=True)
        box = {}
        joiner = threading.Thread(target=lambda: box.update(g=group.join(self.store, 0, 2, token, TIMEOUT_S)))
        joiner.start()
        if engine is None:
            config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
                data_parallel_index=0, world_size=1, rank=0), model_config=None)
            engine = gloo_backend.GlooWeightTransferEngine(None, config, torch.device("cpu"), Model())
        engine.init_transfer_engine(gloo_backend.GlooInitInfo(
            master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, token=token,
            timeout_s=TIMEOUT_S, staged=True))
        joiner.join()
        self.engine, self.sender = engine, box["g"]

    def open(self, buckets):
        """A staged session with every bucket queued on the worker (nothing sent yet)."""
        self.engine.start_weight_update()
        for named in buckets:
            self.engine.update_weights(packing.layout(named).to_dict())

    def send(self, buckets):
        for named in buckets:
            group.broadcast(self.sender, packing.pack(named)[1])


def test_staged_buckets_arrive_while_the_worker_is_free_and_load_only_at_the_finish(reload_hooks):
    s = Session()
    model = s.engine.model
    # each update_weights returns before the sender has sent anything: were it waiting for its
    # bytes, this test would never reach the send below
    s.open(BUCKETS)
    sending = threading.Thread(target=s.send, args=(BUCKETS,))
    sending.start()
    sending.join(TIMEOUT_S * 3)
    assert not sending.is_alive() and model.events == []     # staged, nothing loaded yet
    s.engine.finish_weight_update()
    assert model.events == ["init", "load", "load", "load", "final"]
    expected = dict(kv for named in BUCKETS for kv in named)
    assert set(model.loaded) == set(expected) and all(torch.equal(model.loaded[k], v) for k, v in expected.items())

    # the next push stages into the same buffers once the model holds no view of them
    second = [[(n, t + 1) for n, t in named] for named in BUCKETS]
    s.open(second)
    s.send(second)
    s.engine.finish_weight_update()
    assert all(torch.equal(model.loaded[n], t) for named in second for n, t in named)
    s.engine.shutdown()


def test_a_failed_receive_loads_nothing(reload_hooks):
    s = Session()
    model = s.engine.model
    s.open(BUCKETS)
    s.send(BUCKETS[:1])
    wires.GlooWire.drop(s.sender)           # the sender dies after the first bucket
    s.sender = None
    with pytest.raises(StagingError, match="not received"):
        s.engine.finish_weight_update()
    assert model.events == [] and model.loaded == {}
    s.engine.shutdown()


def test_a_session_the_sender_gave_up_on_is_discarded_and_the_next_one_loads(reload_hooks):
    s = Session()
    model = s.engine.model
    s.open(BUCKETS)
    s.send(BUCKETS[:2])                      # the push fails here; the trainer forms a new group
    s2 = Session(s.engine)
    s2.engine.finish_weight_update()         # vLLM's stale session closed: nothing loaded, no error
    assert model.events == [] and model.loaded == {}
    s2.open(BUCKETS)
    s2.send(BUCKETS)
    s2.engine.finish_weight_update()
    assert model.events == ["init", "load", "load", "load", "final"] and len(model.loaded) == 6
    s2.engine.shutdown()
