"""A copy of a model folder whose config allows more positions (max_position_embeddings).

The tiny model has RoPE and no learned position table, so the weights serve any length: the
engine tests and the benches that need requests longer than the tiny model's 256 positions
run a copy with a larger limit. The one home of that copy (tests/e2e/test_http_engine.py,
bench/stream_gaps.py, bench/rollout_speedup.py).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def with_positions(src: Path, dst: Path, positions: int) -> Path:
    """`dst`: the files of `src` with max_position_embeddings >= `positions` (a copy made once;
    reused while its limit suffices)."""
    src, dst = Path(src), Path(dst)
    cfg_path = dst / "config.json"
    if cfg_path.exists() and json.loads(cfg_path.read_text()).get("max_position_embeddings", 0) >= positions:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = max(positions, cfg.get("max_position_embeddings", 0))
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst
