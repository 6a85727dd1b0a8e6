"""Prompt datasets and a resumable, seeded sampler over them.

A dataset is one or more JSONL or parquet files (docs/data.md; data.prompts may name a glob, a
list or a weighted mixture: megarl/data/sources.py); each row holds the prompt as text
(`data.prompt_key`) or as chat messages (`data.messages_key`, or a list of messages under
`data.prompt_key`, veRL's rows), rendered with the tokenizer's chat template when encoded, and,
for verifiers that need one, a gold answer (`data.answer_key`). Keys may be dotted
(`reward_model.ground_truth`). Rows are checked once at load, so a bad row stops the run before
anything expensive starts.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.data.builders import how_to_build
from megarl.data.render import PromptFormat, check_chat_template, encode_prompts, prompt_text  # noqa: F401 - their home
from megarl.data.seeds import epoch_shuffle_seed
from megarl.data.sources import SETTING, flatten_dotted, parse_sources, source_files


class Records(list):
    """The dataset's records, with the file's row number of each (`rows[i]`, as error
    messages name them: JSONL line numbers, parquet rows from 1), the file it came from
    (`file_names[files[i]]`) and its source (`sources[i]`; `weights[s]` per source of a
    mixture, else None)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rows: list[int] = []
        self.files: list[int] = []
        self.file_names: list[str] = []
        self.sources: list[int] = []
        self.weights: list[float] | None = None
        self.dropped = 0   # prompts dropped for their length (megarl/preflight.py)

    def where(self, i: int, setting: str = SETTING) -> str:
        """`data.prompts='file', row N` of record i."""
        name = self.file_names[self.files[i]] if self.files else "?"
        return f"{setting}={name!r}, row {self.rows[i] if self.rows else i + 1}"

    def source_sizes(self) -> list[int]:
        sizes = [0] * (max(self.sources, default=-1) + 1)
        for s in self.sources:
            sizes[s] += 1
        return sizes

    def keep(self, indices: list[int]) -> None:
        """Only the records at `indices` (in order), in place, with their row, file and source."""
        for name in ("rows", "files", "sources"):
            values = getattr(self, name)
            if values:
                setattr(self, name, [values[i] for i in indices])
        self[:] = [self[i] for i in indices]

    def extend_from(self, other: "Records", source: int) -> None:
        base = len(self.file_names)
        self.file_names += other.file_names
        self.extend(other)
        self.rows += other.rows
        self.files += [base + f for f in other.files]
        self.sources += [source] * len(other)


def load_dataset(data, answer_key: str | None = None) -> Records:
    """The records of every file data.prompts names (`data`: the DataConfig), source by source;
    `answer_key` as load_prompts. A mixture's records carry its weights."""
    sources = parse_sources(data.prompts)
    records = Records()
    for s, source in enumerate(sources):
        for path in source_files(source):
            records.extend_from(load_prompts(path, data.prompt_key, data.messages_key, answer_key), s)
    if sources[0].weight is not None:
        records.weights = [src.weight for src in sources]
    return records


def load_prompts(path: str, prompt_key: str = "prompt", messages_key: str = "messages",
                 answer_key: str | None = None, setting: str = "data.prompts") -> list[dict]:
    """Records of a .jsonl or .parquet file. Each row must hold `prompt_key` (a non-empty text)
    or `messages_key` (a non-empty list of {"role", "content"} texts); with `answer_key` set
    (the verifier needs a gold answer) also that field, a text or a number. Errors name the
    file as `setting` (the setting that gave it)."""
    p = Path(path)
    if p.is_dir():
        raise FileNotFoundError(f"{setting}={path!r} is a folder: point it at a .jsonl or .parquet file in it")
    if not p.is_file():
        raise FileNotFoundError(f"{setting}={path!r} does not exist: {how_to_build(path)}, or point "
                                f"{setting} at a .jsonl or .parquet file")
    records = Records()
    records.file_names = [path]
    for row, rec in _rows(p, path, setting):
        flatten_dotted(rec, (prompt_key, messages_key, answer_key))
        _check_row(rec, path, row, prompt_key, messages_key, answer_key, setting)
        records.append(rec)
        records.rows.append(row)
        records.files.append(0)
    if not records:
        raise ConfigError(f"{setting}={path!r} holds no records: point it at a .jsonl file with one "
                          f"{{\"{prompt_key}\": ...}} object per line, or a .parquet file with rows")
    return records


def _rows(p: Path, path: str, setting: str):
    """(row number, record) pairs: JSONL rows are line numbers (blank lines skipped), parquet
    rows count from 1."""
    if p.suffix.lower() == ".parquet":
        try:   # here: only parquet datasets need pyarrow
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{setting}={path!r}: reading parquet needs pyarrow (a megarl "
                              f"dependency): `pip install pyarrow`, or give a .jsonl file") from None
        try:
            table = pq.read_table(p)
        except Exception as err:   # pyarrow raises several types for a file that is not parquet
            raise ConfigError(f"{setting}={path!r}: not a readable parquet file ({err}): "
                              f"rewrite it, or give a .jsonl file") from None
        # a column holds a null where a row has no such field (mixed text and chat rows):
        # a missing field, as in JSONL
        for row, rec in enumerate(table.to_pylist(), 1):
            yield row, {k: v for k, v in rec.items() if v is not None}
        return
    try:
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as err:
                    hint = (" (the file looks like one JSON array or object: write one JSON object per "
                            "line, JSONL)") if line.strip() in ("[", "{") else ""
                    raise ConfigError(f"{setting}={path!r}, row {lineno}: not JSON ({err}){hint}: fix or "
                                      f"remove that row") from None
                yield lineno, rec
    except UnicodeDecodeError as err:
        raise ConfigError(f"{setting}={path!r}: not a text file ({err.reason} at byte {err.start}): give a "
                          f"UTF-8 .jsonl file (one JSON object per line) or a .parquet file") from None


def _check_row(rec, path: str, row: int, prompt_key: str, messages_key: str, answer_key: str | None,
               setting: str) -> None:
    where = f"{setting}={path!r}, row {row}"
    if not isinstance(rec, dict) or (prompt_key not in rec and messages_key not in rec):
        fields = _fields(rec) if isinstance(rec, dict) else type(rec).__name__
        raise ConfigError(f"{where}: no field {prompt_key!r} (data.prompt_key) nor {messages_key!r} "
                          f"(data.messages_key); the row has {fields}: set data.prompt_key / "
                          f"data.messages_key (a dotted name reaches into an object) or fix the row")
    prompt = rec.get(prompt_key)
    if isinstance(prompt, list):   # chat messages under the prompt field (veRL's rows)
        _check_messages(prompt, where, prompt_key, "data.prompt_key")
    elif isinstance(prompt, str) or messages_key not in rec:
        # a text prompt (it wins over messages when a row holds both)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where}: field {prompt_key!r} (data.prompt_key) is {prompt!r}, not a non-empty "
                              f"text nor a list of chat messages: fix the row")
    else:
        _check_messages(rec[messages_key], where, messages_key, "data.messages_key")
    if answer_key is not None:
        if answer_key not in rec:
            raise ConfigError(f"{where}: no field {answer_key!r} (data.answer_key), which the verifier "
                              f"reward.fn needs; the row has {_fields(rec)}: set data.answer_key (a dotted name reaches"
                              f" into an object: reward_model.ground_truth) or fix the row")
        answer = rec[answer_key]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise ConfigError(f"{where}: field {answer_key!r} (data.answer_key) is {answer!r}, not a "
                              f"non-empty text or number: fix the row")


def _fields(rec: dict) -> list[str]:
    """The row's field names, those of an object one level down as dotted names."""
    out = []
    for k, v in rec.items():
        out += [f"{k}.{sub}" for sub in v] if isinstance(v, dict) and v else [str(k)]
    return sorted(out)


def _check_messages(messages, where: str, key: str, setting: str) -> None:
    problem = _messages_problem(messages)
    if problem:
        raise ConfigError(f"{where}: field {key!r} ({setting}) {problem}: fix the row, a list of "
                          f"{{\"role\": ..., \"content\": ...}} objects with texts, e.g. "
                          f"[{{\"role\": \"user\", \"content\": \"What is 1+1?\"}}]")


def _messages_problem(messages) -> str:
    """Why `messages` is not a chat (empty when it is one)."""
    if not isinstance(messages, list) or not messages:
        return f"is {messages!r}, not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"has message {i} = {m!r}, not a {{\"role\": text, \"content\": text}} object"
    return ""


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
            random.Random(epoch_shuffle_seed(self.seed, self.epoch)).shuffle(order)
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

    @property
    def drawn(self) -> int:
        """Prompts taken so far (a resumed sampler counts those before its checkpoint)."""
        return self.epoch * self.size + self.cursor

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        if "epoch" not in state:
            raise ConfigError(f"data.prompts: the checkpoint's data stream was drawn from a mixture of "
                              f"{len(state.get('sources', []))} sources and data.prompts now names no mixture: "
                              f"resume with the data.prompts it was written with, or start a new run.dir")
        self.epoch, self.cursor, self._order = state["epoch"], state["cursor"], None
