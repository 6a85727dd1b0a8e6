"""Subprocess body of test_request_errors' in-process case: one real in-process vLLM engine
(AsyncLLM, rollout.engines.mode=inprocess) on the tiny model, the requests it refuses sent
through every caller (request_error_checks.observe); the observations as JSON.
usage: request_error_probe.py MODEL_DIR OUT_JSON LOG_DIR
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # request_error_checks

from megarl.bootstrap import bootstrap

bootstrap()   # before anything imports megatron (megarl/bootstrap.py)

MAX_MODEL_LEN = 256


def main(model_dir: str, out_path: str, log_dir: str) -> None:
    import request_error_checks

    from megarl.config import load_config
    from megarl.preflight import load_tokenizer, read_hf_config
    from megarl.rollout.engines.pool import open_pool
    cfg = load_config("recipes/tiny_cpu.yaml", [
        f"model.path={model_dir}", f"data.prompts={model_dir}/prompts.jsonl", "run.dir=unused",
        "rollout.engines.mode=inprocess", "rollout.engines.count=1", "rollout.engines.timeout_s=120",
        f"rollout.engines.max_model_len={MAX_MODEL_LEN}"])
    sp = open_pool(cfg.rollout, model_dir, 0, log_dir)
    try:
        seen = request_error_checks.observe(sp, load_tokenizer(model_dir), MAX_MODEL_LEN,
                                            read_hf_config(model_dir)["vocab_size"])
    finally:
        sp.close()
    Path(out_path).write_text(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:4])
