"""Subprocess body of test_reward_model: megarl's reward-model scores vs transformers'.
usage: reward_probe.py RM_DIR OUT_JSON key=value...  (rank 0 writes {"ours": [...], "hf": [...]})"""
import json
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def main(rm_dir: str, out_path: str, overrides: list[str]) -> None:
    from megarl.config import load_config
    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    env = init_distributed()
    cpu.apply()
    torch.set_num_threads(1)
    cfg = load_config(None, [f"reward.model_path={rm_dir}", *overrides])
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, 0)
    from transformers import AutoModelForSequenceClassification

    from megarl.data.sample import Sample
    from megarl.models.reward import build_reward_model
    from megarl.ppo.batch import build_batch
    from megarl.rewards.model import sequence_scores
    model = build_reward_model(rm_dir, cfg.parallel.tp, cfg.parallel.pp, torch.float32, 128)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (int(n),), generator=g).tolist() for n in (9, 5, 14, 7)]
    batch = build_batch([Sample(s[:3], s[3:], [0.0] * (len(s) - 3), [0] * (len(s) - 3), True, i)
                         for i, s in enumerate(seqs)], pad_id=0)
    ours = sequence_scores(model, batch, 2)
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [float(hf(torch.tensor([s])).logits[0, 0]) for s in seqs]
    if env.rank == 0:
        json.dump({"ours": ours.tolist(), "hf": ref}, open(out_path, "w"))
    parallel.destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
