"""Samples -> padded tensors, and the response-aligned view every per-token quantity uses.

The batch is padded to its longest row; the passes over it compute micro-batches trimmed to
their own longest (`Batch.trim`, planned by ppo/microbatch.py), so this padding is storage,
not compute.

Two layouts:
- sequence layout [B, L]: prompt + response tokens, right-padded; what the model reads.
- response layout [B, R]: column j is response token j. Logprobs, values, rewards,
  advantages and masks live here, so GAE and the losses never see prompt positions.
`resp_index[i, j]` is the sequence position whose output predicts response token j
(= prompt_len_i - 1 + j): one gather moves model outputs into the response layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from megarl.data.sample import Sample
from megarl.distributed import device as dev
from megarl.ppo.route_layout import batch_routes, route_lengths


@dataclass
class Batch:
    tokens: torch.Tensor        # [B, L] long
    resp_index: torch.Tensor    # [B, R] long
    resp_mask: torch.Tensor     # [B, R] float, 1 on trained response tokens (model tokens; 0 on padding
                                # and on an episode's observation tokens: Sample.mask)
    behav_logp: torch.Tensor    # [B, R] float, engine logprobs
    versions: torch.Tensor      # [B, R] long, policy version of each token
    scores: torch.Tensor        # [B] float, verifier reward
    stopped: torch.Tensor       # [B] bool, ended on EOS
    stored_old: torch.Tensor    # [B, R] float, trainer logprobs stored by partial rollout (a prefix)
    stored_mask: torch.Tensor   # [B, R] bool, where stored_old holds a value
    seq_lens: torch.Tensor      # [B] long, prompt + response tokens of each row (the rest is padding)
    # the rows' (prompt + response, response) lengths on the host, where the batch was built from
    # samples: planning micro-batches reads them without a device-to-host copy (None: `lengths`
    # reads them once)
    host_lens: Optional[tuple] = field(default=None, repr=False, compare=False)
    # Mixture-of-Experts routing replay: [B, L, MoE layers, top-k] expert ids per input position
    # (ppo/route_layout.py; the engine's, or the trainer's own recorded ones under r2); None: none
    routes: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    # [B] long: the positions of each row with engine routes (the rest of `routes` is filler:
    # route_layout.route_lengths), which routing agreement scores; None where nothing scores it
    # (r2's recorded routes, the carry's l_old pass: ppo/step.trainer_logprobs)
    route_lens: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def tensors(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "host_lens" and getattr(self, f.name) is not None}

    def select(self, idx) -> "Batch":
        """Rows `idx` of every field: a list of row positions or a slice (the rows' host
        lengths come along), or an index tensor on the batch's device (they do not)."""
        host = None
        if isinstance(idx, (list, tuple)):
            host = None if self.host_lens is None else tuple(self.host_lens[i] for i in idx)
            idx = dev.put(torch.tensor(idx, dtype=torch.long), self.device)
        elif isinstance(idx, slice) and self.host_lens is not None:
            host = self.host_lens[idx]
        return Batch(**{k: v[idx] for k, v in self.tensors().items()}, host_lens=host)

    def lengths(self) -> tuple:
        """The rows' (prompt + response, response) lengths on the host: `host_lens`, read
        from the device once (one copy for all rows) where the batch was not built with them."""
        if self.host_lens is None:
            self.host_lens = tuple(map(tuple, torch.stack([self.seq_lens, self.response_lens], 1).tolist()))
        return self.host_lens

    def trim(self, length: int, width: int) -> "Batch":
        """The first `length` sequence positions and `width` response columns (views): a
        micro-batch padded only to its own longest row (ppo/microbatch.py). Positions past
        `length` are padding of every row here; resp_index is clamped as build_batch clamps it."""
        per_token = {"resp_mask", "behav_logp", "versions", "stored_old", "stored_mask"}
        out = self.tensors()
        out.update({k: out[k][:, :width] for k in per_token})
        out["tokens"] = self.tokens[:, :length]
        if self.routes is not None:
            out["routes"] = self.routes[:, :length]
        out["resp_index"] = self.resp_index[:, :width].clamp(max=length - 1)
        return Batch(**out, host_lens=self.host_lens)

    @property
    def response_lens(self) -> torch.Tensor:
        """[B] response tokens of each row (model and observation tokens)."""
        return self.seq_lens - self.resp_index[:, 0] - 1

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, target: torch.device) -> "Batch":
        """Every field on `target` (one copy per field)."""
        return Batch(**{k: dev.put(v, target) for k, v in self.tensors().items()}, host_lens=self.host_lens)


def build_batch(samples: list[Sample], pad_id: int, multiple: int = 1,
                target: torch.device | None = None) -> Batch:
    """Pad a list of samples. L = longest prompt+response rounded up to `multiple` (sequence
    parallelism splits L over TP ranks), R = longest response. Built on the host, returned on
    `target` (default: the trainer's device), where the models read it."""
    B = len(samples)
    L = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    L = -(-L // multiple) * multiple
    R = max(max(len(s.response_ids) for s in samples), 1)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    resp_index = torch.zeros((B, R), dtype=torch.long)
    mask = torch.zeros((B, R))
    behav = torch.zeros((B, R))
    versions = torch.zeros((B, R), dtype=torch.long)
    stored = torch.zeros((B, R))
    stored_mask = torch.zeros((B, R), dtype=torch.bool)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if s.mask and len(s.mask) != r:
            raise ValueError(f"sample {i}: {len(s.mask)} mask entries for {r} response tokens")
        tokens[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        resp_index[i] = (p - 1 + torch.arange(R)).clamp(max=L - 1)
        mask[i, :r] = torch.tensor(s.loss_mask, dtype=mask.dtype)
        behav[i, :r] = torch.tensor(s.logprobs)
        versions[i, :r] = torch.tensor(s.versions)
        m = min(len(s.old_logprobs), r)
        if m:
            stored[i, :m] = torch.tensor(s.old_logprobs[:m])
            stored_mask[i, :m] = True
    scores = torch.tensor([s.reward for s in samples], dtype=torch.float)
    stopped = torch.tensor([s.stopped for s in samples])
    host_lens = tuple((len(s.prompt_ids) + len(s.response_ids), len(s.response_ids)) for s in samples)
    lens = torch.tensor([n for n, _ in host_lens], dtype=torch.long)
    routes = batch_routes(samples, L)
    batch = Batch(tokens, resp_index, mask, behav, versions, scores, stopped, stored, stored_mask, lens, host_lens,
                  routes=routes, route_lens=None if routes is None else route_lengths(samples))
    return batch.to(target or dev.current())


def stitch_old_logprobs(computed: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[B, R] l_old: the stored value where partial rollout kept one (computed by the trainer
    under the version that generated that token, before its weights moved on), the freshly
    computed one elsewhere (tokens of the current version). Sync rollout stores nothing."""
    return torch.where(batch.stored_mask, batch.stored_old.to(computed.dtype), computed)


def response_targets(batch: Batch) -> torch.Tensor:
    """[B, R] token ids of the response (what resp_index positions predict)."""
    L = batch.tokens.shape[1]
    return batch.tokens.gather(1, (batch.resp_index + 1).clamp(max=L - 1))


def to_response_layout(x: torch.Tensor, resp_index: torch.Tensor) -> torch.Tensor:
    """x [b, L, ...] in sequence layout -> [b, R, ...] at the positions predicting responses."""
    idx = resp_index
    for _ in range(x.dim() - 2):
        idx = idx.unsqueeze(-1)
    return x.gather(1, idx.expand(*resp_index.shape, *x.shape[2:]))
