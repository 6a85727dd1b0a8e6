"""Subprocess body of test_model_families: megarl's megatron actor vs transformers, per family.

For each HF checkpoint folder given, build the actor at the launched layout (TP x PP from
key=value overrides) and compare the per-token logprobs of fixed random sequences with
transformers' forward. Rank 0 writes {folder: max_abs_diff} to OUT_JSON.
usage: model_probe.py OUT_JSON DIR[,DIR...] key=value...
"""
import json
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)


def main(out_path: str, folders: str, overrides: list[str]) -> None:
    from megarl.config import load_config
    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    env = init_distributed()
    cpu.apply()
    torch.set_num_threads(1)
    result = {}
    for folder in folders.split(","):
        cfg = load_config(None, [f"model.path={folder}", "algo.name=grpo", *overrides])
        parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, 0)
        from transformers import AutoModelForCausalLM

        from megarl.models.setup import build_all
        from megarl.ppo import actor as actor_ops
        from megarl.ppo.batch import build_batch
        from megarl.data.sample import Sample
        models = build_all(cfg, with_tokenizer=False)
        vocab = models.actor.info.vocab_size
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in (12, 7, 20, 9)]
        samples = [Sample(s[:3], s[3:], [0.0] * (len(s) - 3), [0] * (len(s) - 3), True, i)
                   for i, s in enumerate(seqs)]
        batch = build_batch(samples, 0)
        ours = actor_ops.logprobs(models.actor.model, batch, 2, vocab)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        diff = 0.0
        with torch.no_grad():
            for i, s in enumerate(seqs):
                lp = torch.log_softmax(hf(torch.tensor([s])).logits[0].float(), -1)
                ref = lp[2:-1].gather(-1, torch.tensor(s[3:])[:, None])[:, 0]
                diff = max(diff, float((ours[i, :len(ref)] - ref).abs().max()))
        result[folder] = diff
        parallel.destroy()
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
