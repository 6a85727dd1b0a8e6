"""The batching rule (megarl/ppo/microbatch.py): which rows form which micro-batch on which DP
rank, padded to what length. Pure functions of the row lengths; the passes that run these plans
on real ranks are tests/dist/test_token_budget.py."""
import random

import numpy as np
import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.data.sample import Sample
from megarl.ppo.batch import build_batch
from megarl.ppo.microbatch import Batching, Usage, balance, batching_of, carry_layout, plan_batch, plan_rows, round_up


def pareto_lengths(count: int, seed: int, prompt: int = 20, cap: int = 384) -> tuple[list[int], list[int]]:
    """(sequence lengths, response lengths): pareto(1.3, xmin 6) responses, as the bench's workload."""
    rng = np.random.default_rng(seed)
    resp = [int(v) for v in np.clip(np.rint(6 * (1.0 - rng.random(count)) ** (-1 / 1.3)), 1, cap)]
    return [prompt + r for r in resp], resp


RULES = [Batching(micro_batch_size=4), Batching(micro_batch_size=3, multiple=2), Batching(max_tokens=512),
         Batching(max_tokens=420, multiple=4), Batching(micro_batch_size=4, remove_padding=False)]


def check_plan(plan, seq, resp, rule, dp):
    """The invariants every plan keeps."""
    assert len(plan.ranks) == dp
    counts = {len(r) for r in plan.ranks}
    assert len(counts) == 1 and plan.micro_batches >= 1, "every DP rank runs as many micro-batches"
    seen = []
    for r in range(dp):
        rows, micro, real = plan.local(r)
        seen += [rows[j] for j in range(len(rows)) if real[j]]
        for mb in micro:
            assert mb.rows and mb.fill <= len(mb.rows)
            assert mb.length % rule.multiple == 0 and mb.width >= 1
            for j in mb.rows:
                assert seq[rows[j]] <= mb.length and resp[rows[j]] <= mb.width
            if rule.by_tokens:
                assert mb.tokens <= rule.max_tokens
            else:
                assert len(mb.rows) <= rule.micro_batch_size
    assert sorted(seen) == list(range(len(seq))), "each row computed once, on one rank"
    assert plan.real_tokens == sum(seq)
    assert plan.computed_tokens >= plan.real_tokens


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r}")
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_every_plan_computes_each_row_once_with_equal_micro_batch_counts(rule, dp):
    for seed in range(6):
        count = random.Random(seed).choice([1, 2, 5, 16, 33, 64])
        if not rule.remove_padding and count % dp:
            continue
        seq, resp = pareto_lengths(count, seed, cap=380)
        check_plan(plan_rows(seq, resp, rule, dp), seq, resp, rule, dp)


def test_removing_padding_computes_close_to_the_real_tokens_on_long_tailed_lengths():
    seq, resp = pareto_lengths(64, 3)
    padded = plan_rows(seq, resp, Batching(micro_batch_size=8, remove_padding=False), 1)
    by_rows = plan_rows(seq, resp, Batching(micro_batch_size=8), 1)
    by_tokens = plan_rows(seq, resp, Batching(max_tokens=1024), 1)
    assert padded.computed_tokens / padded.real_tokens > 3       # the step's longest row sets every length
    assert by_rows.computed_tokens / by_rows.real_tokens < 1.3
    assert by_tokens.computed_tokens / by_tokens.real_tokens < 1.3
    # the budget packs short rows together: fewer, fuller micro-batches than 8 rows each
    assert by_tokens.micro_batches < by_rows.micro_batches


def test_dp_ranks_hold_about_the_same_tokens_not_the_same_rows():
    seq, resp = pareto_lengths(64, 11)
    plan = plan_rows(seq, resp, Batching(max_tokens=1024), 4)
    consecutive = [sum(seq[r * 16:(r + 1) * 16]) for r in range(4)]   # equal rows, in order
    assert plan.imbalance < 1.15
    assert plan.imbalance < max(consecutive) / (sum(consecutive) / 4)
    assert len({len(plan.local(r)[0]) for r in range(4)}) > 1         # rows per rank differ


def test_balance_with_a_row_count_gives_every_rank_its_share_of_rows():
    seq, _ = pareto_lengths(30, 5)
    parts = balance(seq, 4, equal_rows=True)
    assert sorted(len(p) for p in parts) == [7, 7, 8, 8]
    assert sorted(i for p in parts for i in p) == list(range(30))


def test_fewer_rows_than_micro_batches_fill_with_the_shortest_row_at_mask_zero():
    seq, resp = [100, 40, 30], [90, 30, 20]
    plan = plan_rows(seq, resp, Batching(max_tokens=100), 2)   # the long row alone; 40 + 30 padded to 40: 2 rows
    check_plan(plan, seq, resp, Batching(max_tokens=100), 2)
    fills = [mb for r in plan.ranks for mb in r if mb.fill]
    assert plan.micro_batches == 1 or fills
    one = plan_rows([9], [4], Batching(micro_batch_size=8), 3)   # one row, three ranks
    assert [len(r) for r in one.ranks] == [1, 1, 1]
    assert sum(mb.fill for r in one.ranks for mb in r) == 2
    assert all(mb.rows == (0,) and mb.length == 9 for r in one.ranks for mb in r)


def test_the_padded_layout_is_the_one_before_length_aware_batching():
    seq, resp = [5, 9, 7, 6, 12, 3, 4, 8], [2, 6, 4, 3, 9, 1, 1, 5]
    plan = plan_rows(seq, resp, Batching(micro_batch_size=2, remove_padding=False), 2, full=(14, 10))
    assert [[mb.rows for mb in r] for r in plan.ranks] == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert {(mb.length, mb.width) for r in plan.ranks for mb in r} == {(14, 10)}
    # the carry's layout: 61 rows over 2 ranks of at most 16 rows: 2 x 16 per rank, 3 fillers
    carry = plan_rows([4] * 61, [2] * 61, Batching(micro_batch_size=16, remove_padding=False), 2)
    assert carry_layout(61, 2, 16) == (32, 16)
    assert [len(mb.rows) for r in carry.ranks for mb in r] == [16, 16, 16, 16]
    assert sum(mb.fill for r in carry.ranks for mb in r) == 3


def test_a_row_longer_than_the_budget_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"train\.max_tokens_per_micro_batch=64 .*70 tokens"):
        plan_rows([70, 10], [60, 5], Batching(max_tokens=64), 1)
    with pytest.raises(ValueError, match=r"padded to 72"):
        plan_rows([70], [60], Batching(max_tokens=71, multiple=8), 1)


def test_plan_of_a_batch_reads_its_row_and_response_lengths():
    samples = [Sample([1, 2, 3], [5] * n, [-1.0] * n, [0] * n, True, 0) for n in (1, 7, 3, 12)]
    batch = build_batch(samples, 0, target=torch.device("cpu"))
    assert batch.seq_lens.tolist() == [4, 10, 6, 15]
    assert batch.response_lens.tolist() == [1, 7, 3, 12]
    plan = plan_batch(batch, 2, 1)
    assert [(mb.rows, mb.length, mb.width) for mb in plan.ranks[0]] == [((3, 1), 15, 12), ((2, 0), 6, 3)]
    sub = batch.select(torch.tensor([2, 0])).trim(6, 3)
    assert sub.tokens.shape == (2, 6) and sub.resp_mask.shape == (2, 3)
    assert sub.tokens[0].tolist() == batch.tokens[2, :6].tolist()
    assert int(sub.resp_index.max()) <= 5


def test_usage_reports_padding_micro_batches_and_imbalance():
    seq, resp = pareto_lengths(32, 2)
    usage = Usage()
    rule = Batching(max_tokens=800)
    plans = [plan_rows(seq, resp, rule, 2), plan_rows(seq[:16], resp[:16], rule, 2)]
    for p in plans:
        usage.add(p)
    m = usage.metrics()
    computed = sum(p.computed_tokens for p in plans)
    assert m["train_tokens_computed"] == computed
    assert m["train_padding_frac"] == pytest.approx(1 - sum(p.real_tokens for p in plans) / computed)
    assert m["train_micro_batches"] == pytest.approx(sum(p.micro_batches for p in plans) / 2)
    assert m["train_dp_token_imbalance"] == max(p.imbalance for p in plans) >= 1.0
    assert Usage().metrics() == {}


def test_round_up():
    assert [round_up(x, 4) for x in (1, 4, 5, 8)] == [4, 4, 8, 8]


def test_token_budget_and_row_count_are_one_choice(tmp_path):
    cfg = load_config(None, ["train.max_tokens_per_micro_batch=512", "rollout.engines.max_model_len=256"])
    assert cfg.train.max_tokens_per_micro_batch == 512
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=4.*train\.max_tokens_per_micro_batch=0"):
        load_config(None, ["train.max_tokens_per_micro_batch=512", "train.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"train\.max_tokens_per_micro_batch=200.*at least 256"):
        load_config(None, ["train.max_tokens_per_micro_batch=200", "rollout.engines.max_model_len=256"])
    with pytest.raises(ConfigError, match=r"train\.remove_padding=False"):
        load_config(None, ["train.max_tokens_per_micro_batch=512", "train.remove_padding=false"])
    with pytest.raises(ConfigError, match=r"train\.max_tokens_per_micro_batch=-2"):
        load_config(None, ["train.max_tokens_per_micro_batch=-2"])


@pytest.mark.parametrize("max_model_len", [256, 1000])
def test_the_token_budget_is_on_by_default_and_derived_from_the_context(max_model_len):
    """Unset (-1), the budget is BUDGET_PER_CONTEXT engine contexts (padded to TP under sequence
    parallelism); a recipe or command line that sets micro_batch_size chooses rows instead, at
    any value, the old default 8 included; 0 chooses rows at ROWS_PER_MICRO_BATCH."""
    from megarl.config.schema.algo import ROWS_PER_MICRO_BATCH
    from megarl.config.schema.root import BUDGET_PER_CONTEXT
    ctx = f"rollout.engines.max_model_len={max_model_len}"
    cfg = load_config(None, [ctx])
    budget = BUDGET_PER_CONTEXT * max_model_len
    assert (cfg.train.max_tokens_per_micro_batch, cfg.train.micro_batch_size) == (budget, None)
    assert batching_of(cfg).by_tokens
    for mbs in (ROWS_PER_MICRO_BATCH, 4):
        cfg = load_config(None, [ctx, f"train.micro_batch_size={mbs}"])
        assert (cfg.train.max_tokens_per_micro_batch, cfg.train.rows_per_micro_batch) == (0, mbs)
        assert not batching_of(cfg).by_tokens
    cfg = load_config(None, [ctx, "train.max_tokens_per_micro_batch=0"])
    assert (cfg.train.max_tokens_per_micro_batch, cfg.train.rows_per_micro_batch) == (0, ROWS_PER_MICRO_BATCH)
    sp = load_config(None, [ctx, "parallel.tp=3", "parallel.sequence_parallel=true"])
    assert sp.train.max_tokens_per_micro_batch == BUDGET_PER_CONTEXT * (-(-max_model_len // 3) * 3)


def test_a_later_layer_chooses_rows_or_tokens_over_an_earlier_one(tmp_path):
    """micro_batch_size and max_tokens_per_micro_batch are two answers to one question: the
    command line (or a recipe over its `defaults:`) that gives one replaces the recipe's other,
    as it would replace the same key; one layer giving both is still refused."""
    rows = tmp_path / "rows.yaml"
    rows.write_text("train:\n  micro_batch_size: 16\n")
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("defaults: [rows.yaml]\ntrain:\n  max_tokens_per_micro_batch: 4096\n")
    for cfg in (load_config(rows, ["train.max_tokens_per_micro_batch=4096"]), load_config(tokens)):
        assert (cfg.train.max_tokens_per_micro_batch, cfg.train.micro_batch_size) == (4096, None)
    cfg = load_config(tokens, ["train.micro_batch_size=4"])
    assert (cfg.train.max_tokens_per_micro_batch, cfg.train.micro_batch_size) == (0, 4)
    # turning the budget off (its unused value) leaves the recipe's row count as it is
    assert load_config(rows, ["train.max_tokens_per_micro_batch=0"]).train.micro_batch_size == 16
    with pytest.raises(ConfigError, match=r"train\.micro_batch_size=4.*train\.max_tokens_per_micro_batch=0"):
        load_config(rows, ["train.max_tokens_per_micro_batch=4096", "train.micro_batch_size=4"])
