"""Where `data.prompts` points (docs/data.md): one file, a glob, a list of them (one dataset),
or a weighted mixture of such sources; and dotted field names (`reward_model.ground_truth`).

`parse_sources` (config/schema/data.py) reads the setting's value when the config loads, no
file touched; `source_files` expands a source's globs when the data is read. Light: no tokenizer, no pyarrow.
"""
from __future__ import annotations

import glob

from megarl.config.schema.data import SETTING, Source, parse_sources  # noqa: F401 - read here too

GLOB_CHARS = "*?["


def source_files(source: Source, setting: str = SETTING) -> list[str]:
    """The files of a source, globs expanded (sorted, so every process reads the same order);
    a glob that matches nothing is one line. A plain name is returned as is (the reader names
    a missing file)."""
    files = []
    for p in source.paths:
        if not any(c in p for c in GLOB_CHARS):
            files.append(p)
            continue
        found = sorted(f for f in glob.glob(p, recursive=True) if not f.endswith((".crc", ".tmp")))
        if not found:
            raise FileNotFoundError(f"{setting}: the glob {p!r} matches no file: fix the pattern (relative to "
                                    f"the working directory, ** for subfolders) or name the files")
        files += found
    return files


def get_field(record: dict, key: str):
    """record[key]; a dotted key not in the record reaches into nested objects
    (`reward_model.ground_truth`). KeyError when absent."""
    if key in record:
        return record[key]
    node = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


def flatten_dotted(record, keys) -> None:
    """Each dotted key of `keys` that reaches a value in `record` is also set on it under its
    dotted name, so every reader (the verifier's record[data.answer_key] included) finds it."""
    if not isinstance(record, dict):
        return
    for key in keys:
        if key and "." in key and key not in record:
            try:
                record[key] = get_field(record, key)
            except KeyError:
                pass
