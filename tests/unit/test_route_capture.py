"""The engine workers' route book (megarl/rollout/engines/route_capture.py) without vLLM: a step's
flattened rows go to their requests by the runner's layout, a position keeps its first row, a
prefix-cache hit takes the rows of the KV slots it reuses, and take / keep / the dense refusal."""
import numpy as np
import pytest
import torch

from megarl.rollout.engines import route_capture
from megarl.rollout.engines.engine import EngineError

BLOCK = 4


def step(book, reqs, starts, counts, tables, ids_of):
    """One runner step: requests `reqs` with counts[i] tokens from starts[i]; `tables[i]`: the
    request's KV block ids; ids_of(request, position, layer) -> its experts."""
    counts, starts = np.array(counts), np.array(starts)
    blocks = np.array(tables)

    def slots(rows, pos):
        return blocks[rows, pos // BLOCK] * BLOCK + pos % BLOCK
    rows = np.repeat(np.arange(len(reqs)), counts)
    pos = np.concatenate([s + np.arange(c) for s, c in zip(starts, counts)])
    book.begin(reqs, starts, counts, slots(rows, pos), lambda i, m: slots(np.full(m, i), np.arange(m)))
    book.active = True
    for layer in (1, 3):    # the model's MoE layers (global ids)
        book.capture(layer, torch.tensor([ids_of(reqs[r], p, layer) for r, p in zip(rows, pos)]))
    book.active = False
    book.end()


def experts(req, pos, layer, salt=0):
    return [(sum(map(ord, req)) + pos + layer + salt) % 8, (pos * 3 + layer + salt + 1) % 8]


def want(req, n, salt=0):
    return np.array([[experts(req, p, lid, salt) for lid in (1, 3)] for p in range(n)], np.uint8)


def test_a_steps_rows_go_to_their_requests_by_position():
    book = route_capture.RouteBook([3, 1], top_k=2, num_experts=8)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    step(book, ["a-1", "b-2"], [0, 0], [5, 3], tables, experts)        # both prefill
    step(book, ["a-1", "b-2"], [5, 3], [1, 1], tables, experts)        # one decode step each
    got = book.take(["a", "b"], keep=False)
    assert np.array_equal(route_capture.from_state(got["a"]), want("a-1", 6))
    assert np.array_equal(route_capture.from_state(got["b"]), want("b-2", 4))
    assert book.take(["a"], keep=False) == {}                            # taken once


def test_a_recomputed_position_keeps_its_first_row_and_keep_leaves_the_rows():
    book = route_capture.RouteBook([1, 3], top_k=2, num_experts=8)
    tables = [[0, 1, 2, 3]]
    step(book, ["a-1"], [0], [6], tables, experts)
    step(book, ["a-1"], [0], [7], tables, lambda r, p, lid: experts(r, p, lid, salt=5))   # KV dropped: recompute
    rows = route_capture.from_state(book.take(["a"], keep=True)["a"])
    assert np.array_equal(rows[:6], want("a-1", 6))                     # the rows that produced its tokens
    assert np.array_equal(rows[6], want("a-1", 7, salt=5)[6])            # the new position: the new weights'
    assert "a" in book.take(["a"], keep=False)


def test_a_prefix_cache_hit_takes_the_rows_of_the_blocks_it_reuses():
    book = route_capture.RouteBook([1, 3], top_k=2, num_experts=8)
    step(book, ["a-1"], [0], [10], [[2, 5, 7]], experts)                 # blocks 2, 5, 7
    # b shares a's first two blocks (8 cached tokens) and computes the rest itself
    step(book, ["b-2"], [8], [3], [[2, 5, 9]], experts)
    rows = route_capture.from_state(book.take(["b"], keep=False)["b"])
    assert np.array_equal(rows[:8], want("a-1", 8))                      # computed by a, in the blocks
    assert np.array_equal(rows[8:], want("b-2", 11)[8:])
    assert book.from_cache == 8


def test_a_warm_up_forward_outside_a_step_is_not_captured():
    book = route_capture.RouteBook([1], top_k=2, num_experts=300)
    book.capture(1, torch.zeros(4, 2, dtype=torch.int64))
    assert book.step is None and book.dtype == np.uint16                # past 256 experts: uint16


def test_routes_asked_of_a_dense_model_are_refused_naming_the_setting():
    with pytest.raises(EngineError, match="algo.routing_replay=r3.*no Mixture-of-Experts layer.*routing_replay=off"):
        route_capture.started([{"layers": 0, "top_k": 0}], "engine0", "dense")
    assert route_capture.started([{"layers": 2, "top_k": 2}], "engine0", "moe")
