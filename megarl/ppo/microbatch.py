"""Which rows form which micro-batch, on which DP rank, padded to what length.

Every pass over a batch (the update, old and reference logprobs, values, the reward model,
the carry's stitched l_old, the intra-step overlap's passes) runs the micro-batches of one
`Plan`, made by the same rule (`Batching`, from train.*):

- remove_padding (the default): rows are dealt to the DP ranks longest first, each to the
  rank holding the fewest tokens, so every rank computes about the same number of tokens
  (with a fixed row count, train.micro_batch_size, every rank also gets the same number of
  rows, give or take one). Each rank sorts its rows by length and cuts them into micro-batches
  padded only to their own longest row (rounded up to `multiple`: sequence parallelism splits
  the sequence over TP ranks): `micro_batch_size` rows each, or, with a token budget
  (train.max_tokens_per_micro_batch), as many rows as fit the budget in padded tokens
  (rows x padded length), so short rows share a micro-batch and long ones do not.
- padded (train.remove_padding=false): rows in order, equal consecutive shares per DP rank,
  micro_batch_size rows per micro-batch, every one padded to the whole batch's width: the
  layout before length-aware batching, kept for comparisons (tests, the bench).

Every DP rank runs the same number of micro-batches per pass (megatron's DP runs one
schedule per rank and reduces gradients after it; the loss scale, ppo/schedule.loss_scale,
counts them): a rank with fewer splits its largest ones; a rank with fewer rows than that
repeats the batch's shortest row as filler rows (`MicroBatch.fill`), trained with mask 0
(no loss, no gradient) and whose outputs are dropped.

Pure functions of the row lengths: every rank derives the same plan without communication.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from megarl.ppo.batch import Batch

# Under a token budget a micro-batch takes the next (shorter) row only while padding stays
# under this share of what it computes: a long row of a long-tailed batch is not padded
# together with short ones (a few more micro-batches instead), so computed / real tokens
# stays under 1 / (1 - 0.2) = 1.25 per micro-batch, whatever the budget.
MAX_PADDING_FRAC = 0.2


@dataclass(frozen=True)
class Batching:
    """The batching rule (train.micro_batch_size, train.max_tokens_per_micro_batch,
    train.remove_padding; `multiple` = TP with sequence parallelism, else 1)."""
    micro_batch_size: int = 8
    max_tokens: int = 0          # > 0: micro-batches by token budget instead of row count
    multiple: int = 1
    remove_padding: bool = True

    @property
    def by_tokens(self) -> bool:
        return self.max_tokens > 0


def batching_of(cfg) -> Batching:
    """The batching rule of a RootConfig."""
    t = cfg.train
    return Batching(t.rows_per_micro_batch, t.max_tokens_per_micro_batch,
                    cfg.parallel.tp if cfg.parallel.sequence_parallel else 1, t.remove_padding)


def as_batching(layout) -> Batching:
    """A Batching, or a plain micro-batch size (rows per micro-batch, padding removed)."""
    return layout if isinstance(layout, Batching) else Batching(micro_batch_size=int(layout))


@dataclass(frozen=True)
class MicroBatch:
    rows: tuple[int, ...]   # positions of its rows in what was planned (the last `fill` are filler)
    length: int             # sequence positions computed: its longest row, rounded up
    width: int              # response columns: its longest response (>= 1)
    fill: int = 0           # trailing filler rows: trained with mask 0, outputs dropped

    @property
    def tokens(self) -> int:
        """Positions computed: rows x padded length."""
        return len(self.rows) * self.length


@dataclass(frozen=True)
class Plan:
    ranks: tuple[tuple[MicroBatch, ...], ...]   # per DP rank, its micro-batches in order
    real_tokens: int                            # prompt + response tokens of the planned rows

    @property
    def micro_batches(self) -> int:
        """Micro-batches per DP rank (the same on every rank)."""
        return len(self.ranks[0]) if self.ranks else 0

    def rank_tokens(self) -> list[int]:
        return [sum(mb.tokens for mb in r) for r in self.ranks]

    @property
    def computed_tokens(self) -> int:
        """Positions computed on all DP ranks, padding and filler rows included."""
        return sum(self.rank_tokens())

    @property
    def imbalance(self) -> float:
        """max / mean of the DP ranks' computed tokens (1.0: balanced)."""
        tokens = self.rank_tokens()
        mean = sum(tokens) / max(1, len(tokens))
        return max(tokens) / mean if mean else 1.0

    def local(self, rank: int) -> tuple[list[int], list[MicroBatch], list[bool]]:
        """Rank `rank`'s rows (positions in what was planned, micro-batch after micro-batch,
        fillers included), its micro-batches re-indexed into that list, and which of those
        rows are real (not filler)."""
        rows: list[int] = []
        micro, real = [], []
        for mb in self.ranks[rank]:
            start = len(rows)
            rows += mb.rows
            real += [True] * (len(mb.rows) - mb.fill) + [False] * mb.fill
            micro.append(replace(mb, rows=tuple(range(start, len(rows)))))
        return rows, micro, real


@dataclass
class Usage:
    """What the plans of a step's passes computed, for its metrics."""
    computed: int = 0
    real: int = 0
    micro_batches: list[int] = field(default_factory=list)
    imbalance: float = 1.0

    def add(self, plan: Plan) -> None:
        self.computed += plan.computed_tokens
        self.real += plan.real_tokens
        self.micro_batches.append(plan.micro_batches)
        self.imbalance = max(self.imbalance, plan.imbalance)

    def metrics(self) -> dict:
        """train_padding_frac: padded (and filler) / computed positions; train_tokens_computed:
        positions computed on all DP ranks; train_micro_batches: per pass and DP rank (mean);
        train_dp_token_imbalance: the largest max / mean of the DP ranks' tokens of a pass."""
        if not self.micro_batches:
            return {}
        return {"train_padding_frac": 1.0 - self.real / max(1, self.computed),
                "train_tokens_computed": self.computed,
                "train_micro_batches": sum(self.micro_batches) / len(self.micro_batches),
                "train_dp_token_imbalance": self.imbalance}


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def carry_layout(count: int, dp: int, micro_batch_size: int) -> tuple[int, int]:
    """(rows per DP rank, micro-batch size) of the padded layout over `count` rows: as few
    micro-batches per rank as micro_batch_size allows, each as small as they can be while all
    are full (61 rows, dp=1, mbs=16: 4 micro-batches of 16, 3 filler rows; 3 rows: one
    micro-batch of 3). Filler is less than a row per micro-batch."""
    per_rank = -(-count // dp)
    n_micro = -(-per_rank // micro_batch_size)
    mbs = -(-per_rank // n_micro)
    return n_micro * mbs, mbs


def plan_rows(seq_lens: Sequence[int], resp_lens: Sequence[int], batching: Batching, dp: int,
              full: tuple[int, int] | None = None) -> Plan:
    """The plan for rows of `seq_lens` tokens (prompt + response) with `resp_lens` response
    tokens over `dp` ranks. `full`: (length, width) the padded layout pads to (the batch's
    tensors); default the longest row, rounded up, and the longest response."""
    n = len(seq_lens)
    real = sum(seq_lens)
    if n == 0:
        return Plan(tuple(() for _ in range(dp)), 0)
    if not batching.remove_padding:
        length, width = full or (round_up(max(seq_lens), batching.multiple), max(1, max(resp_lens)))
        return Plan(_padded(n, dp, batching.micro_batch_size, length, width), real)
    shape = _Shape(seq_lens, resp_lens, batching.multiple)
    if batching.by_tokens:
        longest = max(seq_lens)
        if round_up(longest, batching.multiple) > batching.max_tokens:
            raise ValueError(
                f"train.max_tokens_per_micro_batch={batching.max_tokens} cannot hold a row of {longest} tokens "
                f"(padded to {round_up(longest, batching.multiple)}): raise it to at least "
                f"rollout.engines.max_model_len")
    parts = balance(seq_lens, dp, equal_rows=not batching.by_tokens)
    ranks = [_cut(sorted(p, key=lambda i: (-seq_lens[i], i)), shape, batching) for p in parts]
    filler = min(range(n), key=lambda i: (seq_lens[i], i))
    count = max(1, max(len(r) for r in ranks))
    return Plan(tuple(tuple(_equalize(r, count, shape, filler)) for r in ranks), real)


def plan_batch(batch: Batch, layout, dp: int) -> Plan:
    """The plan of a Batch's rows (`layout`: a Batching or a micro-batch size), from their
    lengths on the host (`Batch.lengths`)."""
    lens = batch.lengths()
    return plan_rows([n for n, _ in lens], [r for _, r in lens], as_batching(layout), dp,
                     (batch.tokens.shape[1], batch.resp_mask.shape[1]))


@dataclass(frozen=True)
class _Shape:
    seq_lens: Sequence[int]
    resp_lens: Sequence[int]
    multiple: int

    def micro(self, rows: Sequence[int], fill: int = 0) -> MicroBatch:
        return MicroBatch(tuple(rows), round_up(max(self.seq_lens[i] for i in rows), self.multiple),
                          max(1, max(self.resp_lens[i] for i in rows)), fill)


def balance(lengths: Sequence[int], dp: int, equal_rows: bool) -> list[list[int]]:
    """Row indices per DP rank: longest first, each to the rank with the fewest tokens so far
    (greedy longest-processing-time). `equal_rows`: every rank gets len // dp rows and len % dp
    of them one more (a fixed micro-batch row count needs equal row counts)."""
    n = len(lengths)
    parts: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    base, extra = divmod(n, dp)
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        if equal_rows:
            full = sum(len(p) > base for p in parts)
            open_ = [r for r in range(dp) if len(parts[r]) < base or (len(parts[r]) == base and full < extra)]
        else:
            open_ = range(dp)
        r = min(open_, key=lambda r: (load[r], len(parts[r]), r))
        parts[r].append(i)
        load[r] += lengths[i]
    return parts


def _cut(rows: list[int], shape: _Shape, batching: Batching) -> list[MicroBatch]:
    """One rank's rows, longest first, cut into micro-batches: by row count (as even as the
    count allows) or, with a token budget, each filled while rows x its first (longest) row's
    padded length fit and padding stays under MAX_PADDING_FRAC of it."""
    if not rows:
        return []
    if not batching.by_tokens:
        k = -(-len(rows) // batching.micro_batch_size)
        size, extra = divmod(len(rows), k)
        out, start = [], 0
        for j in range(k):
            end = start + size + (j < extra)
            out.append(shape.micro(rows[start:end]))
            start = end
        return out
    out, current, real = [], [], 0
    for i in rows:
        length = round_up(shape.seq_lens[current[0] if current else i], shape.multiple)
        n = len(current) + 1
        if current and (n * length > batching.max_tokens
                        or real + shape.seq_lens[i] < (1 - MAX_PADDING_FRAC) * n * length):
            out.append(shape.micro(current))
            current, real = [], 0
        current.append(i)
        real += shape.seq_lens[i]
    out.append(shape.micro(current))
    return out


def _equalize(micro: list[MicroBatch], count: int, shape: _Shape, filler: int) -> list[MicroBatch]:
    """`count` micro-batches: the one with the most rows split in two (halves of a run sorted
    by length) until there are enough; filler micro-batches of one row when every one holds
    a single row."""
    micro = list(micro)
    while len(micro) < count:
        j = max(range(len(micro)), key=lambda j: (len(micro[j].rows), -j), default=None)
        if j is None or len(micro[j].rows) < 2:
            micro.append(shape.micro([filler], fill=1))
            continue
        rows = micro[j].rows
        half = -(-len(rows) // 2)
        micro[j:j + 1] = [shape.micro(rows[:half]), shape.micro(rows[half:])]
    return micro


def _padded(n: int, dp: int, micro_batch_size: int, length: int, width: int) -> tuple:
    """The padded layout (`carry_layout`): consecutive equal shares, whole micro-batches,
    copies of row 0 as filler past the last row."""
    per_rank, size = carry_layout(n, dp, micro_batch_size)
    ranks = []
    for r in range(dp):
        positions = range(r * per_rank, (r + 1) * per_rank)
        micro = []
        for start in range(0, per_rank, size):
            chunk = positions[start:start + size]
            fill = sum(p >= n for p in chunk)
            micro.append(MicroBatch(tuple(p if p < n else 0 for p in chunk), length, width, fill))
        ranks.append(tuple(micro))
    return tuple(ranks)
