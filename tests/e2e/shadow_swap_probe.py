"""Subprocess body of test_shadow_swap: one real vLLM engine (in-process executor, fp32) takes
the same new weights twice, once by vLLM's in-place layerwise reload (what an unstaged push
does in its pause) and once through a shadow (rollout/weights/shadow.py: loaded and processed
beside the live model, the engine's thread advancing it in slices, then swapped in), with the
model's original weights reloaded between the two. Records whether every parameter and buffer
ends bitwise the same, and the prompt logprobs of fixed token ids after each.
usage: shadow_swap_probe.py MODEL_DIR OUT_JSON
"""
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the worker's model in this process

import torch  # noqa: E402

from megarl.bootstrap import bootstrap  # noqa: E402

bootstrap()

PROMPTS = [[1, 5, 9, 12, 7, 3, 22, 17], [1, 30, 4, 4, 11, 19, 2, 8, 6]]


def main(model_dir: str, out: str) -> None:
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    from megarl.rollout.weights import shadow

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=128, trust_remote_code=True,
              kv_cache_memory_bytes=32 << 20, seed=0)
    worker = llm.llm_engine.model_executor.driver_worker.worker
    model, config = worker.get_model(), worker.model_config
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    new = {n: t + 0.02 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in original.items()}

    def in_place(weights):
        initialize_layerwise_reload(model)
        model.load_weights(list(weights.items()))
        finalize_layerwise_reload(model, config)

    def snapshot():
        tensors = {f"p:{n}": t.detach().clone() for n, t in model.named_parameters()}
        tensors.update({f"b:{n}": t.detach().clone() for n, t in model.named_buffers()})
        return tensors

    def logprobs():
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
        return [[list(d.values())[0].logprob for d in o.prompt_logprobs[1:]] for o in outs]

    first = logprobs()
    in_place(new)
    reloaded, reloaded_lp = snapshot(), logprobs()
    in_place(original)
    back_lp = logprobs()
    s = shadow.Shadow(model, config)
    s.feed(list(new.items()))
    s.complete()
    polls = 1
    while not s.advance(0.01):
        polls += 1
    live_during = logprobs()             # prepared, not swapped: still the original version
    swapped_layers = s.swap()
    swapped, swapped_lp = snapshot(), logprobs()
    mismatched = sorted(n for n in reloaded if n not in swapped or not torch.equal(reloaded[n], swapped[n]))
    json.dump({"mismatched": mismatched, "tensors": len(reloaded), "swapped_layers": swapped_layers,
               "polls": polls, "first": first, "reloaded": reloaded_lp, "back": back_lp,
               "live_during": live_during, "swapped": swapped_lp}, open(out, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
