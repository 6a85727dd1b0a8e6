"""Prompt datasets and a resumable, seeded sampler over them."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


def load_jsonl(path: str, prompt_key: str) -> list[dict]:
    """Records of a jsonl file; each must hold `prompt_key` (the prompt text)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data.prompts={path!r} does not exist: build it with "
                                f"`python tools/make_tiny_model.py` or point data.prompts at a jsonl file")
    from megarl.config import ConfigError
    records = []
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as err:
                raise ConfigError(f"data.prompts={path!r}, row {lineno}: not JSON ({err}): fix or remove "
                                  f"that row") from None
            if not isinstance(rec, dict) or prompt_key not in rec:
                fields = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ConfigError(f"data.prompts={path!r}, row {lineno}: no field {prompt_key!r} "
                                  f"(data.prompt_key); the row has {fields}: set data.prompt_key or fix the row")
            if not isinstance(rec[prompt_key], str) or not rec[prompt_key].strip():
                raise ConfigError(f"data.prompts={path!r}, row {lineno}: field {prompt_key!r} (data.prompt_key) "
                                  f"is {rec[prompt_key]!r}, not a non-empty text: fix the row")
            records.append(rec)
    if not records:
        raise ConfigError(f"data.prompts={path!r} holds no records: point it at a jsonl file with one "
                          f"{{\"{prompt_key}\": ...}} object per line")
    return records


@dataclass
class PromptSampler:
    """Walks the dataset in epochs, reshuffled per epoch from (seed, epoch); its state is two
    integers, so a resumed run draws exactly the prompts an uninterrupted one would."""
    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    cursor: int = 0
    _order: list = field(default=None, repr=False)

    def _epoch_order(self) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self._order is None:
                self._order = self._epoch_order()
            if self.cursor == self.size:
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
                continue
            out.append(self._order[self.cursor])
            self.cursor += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self._order = state["epoch"], state["cursor"], None
