"""The converters' output folders: emptied before writing, and the HF folder's side files
(config, tokenizer) copied next to the weights."""
from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

from megarl.formats.hf_reader import INDEX_JSON, ConversionError

# Files of an HF folder that describe the model and tokenizer (everything but the weights).
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                 "added_tokens.json", "vocab*", "merges.txt", "*.model", "*.tiktoken",
                 "chat_template*", "*.py")


def prepare_out(out: str, force: bool) -> Path:
    """The converters' output folder, empty: a non-empty one is refused unless `force`."""
    path = Path(out)
    if path.exists() and any(path.iterdir()):
        if not force:
            raise ConversionError(f"output folder {out!r} is not empty (pass --force to replace it)")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy config, generation config and every tokenizer file (incl. local *.py code that
    tokenizer_config.json's auto_map may name) from src to dst; returns the names copied."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, p) for p in HF_SIDE_FILES) \
                and f.name != INDEX_JSON:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied
