"""The GPU path's one check: run by tests/gpu/device_check.sh on a single-GPU machine.

Each check runs in its own process (megatron's parallel state and NCCL never leak between
checks) and prints one PASS/FAIL line; a summary line and `summary.json` close the run.

- logprobs_fp32 / logprobs_bf16: the actor's logprobs on CUDA (Transformer Engine specs when TE
  is installed) vs transformers on the same GPU, on the recorded rollout's sequences.
- updates: 2 PPO updates (actor, critic, reference) and 2 GRPO updates on the recorded rollout
  (tests/data/rollout_tiny.jsonl, produced on CPU by the real engine), megatron's distributed
  optimizer on one rank, fp32: losses and grad norms on CUDA vs the same run on the CPU of
  the same machine (CUDA hidden) within UPDATE_RTOL.
- checkpoint: one update, save, rebuild from the HF files, load: same logprobs as before saving.
- speed_1b: a 1.1B-parameter Llama-shaped model built locally (random init, bf16 with fp32
  master weights): PPO step time (actor + critic + reference, 16 sequences of 1024 tokens)
  and peak GPU memory, as JSON.

usage: python tests/gpu/device_check.py [--out DIR] [--only a,b] [--device cuda|cpu]
`--device cpu` runs every check on the CPU (the plumbing, here; the speed model is smaller).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests" / "data" / "rollout_tiny.jsonl"
MODEL = ROOT / "artifacts" / "tiny_countdown"
LOGPROB_TOL = {"float32": 1e-4, "bfloat16": 0.1}   # max |ours - transformers| per token
UPDATE_RTOL = 2e-3   # fp32 on two devices: kernels sum in different orders
CHECKS = ["logprobs_fp32", "logprobs_bf16", "updates", "checkpoint", "speed_1b"]


# ---------------------------------------------------------------- child processes
def _setup(overrides: list[str]):
    """Config, process group and megatron state for one rank (as `megarl train` does)."""
    import torch

    from megarl.config import load_config
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed

    cfg = load_config(str(ROOT / "recipes" / "tiny_cpu.yaml"),
                      [f"model.path={MODEL}", "rollout.sampling.n=4", "train.mini_batches=2",
                       "train.micro_batch_size=4", *overrides])
    init_distributed()
    if bootstrap():
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    parallel.initialize(1, 1, cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    return cfg


def child_logprobs(dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.distributed import device as dev
    from megarl.models.builders import use_te
    from megarl.models.setup import build_all
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.rollout.controller.dump import read_samples

    cfg = _setup([f"model.dtype={dtype}", "algo.name=grpo"])
    models = build_all(cfg)
    samples = read_samples(str(RECORDED))[:16:2]
    batch = build_batch(samples, models.tokenizer.pad_token_id)
    ours = actor_ops.logprobs(models.actor.model, batch, 4, models.actor.info.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=getattr(torch, dtype)).to(dev.current())
    worst = 0.0
    with torch.no_grad():
        for i, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.response_ids], device=dev.current())
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            p, r = len(s.prompt_ids), len(s.response_ids)
            ref = lp[p - 1:p - 1 + r].gather(-1, ids[0, p:, None])[:, 0]
            worst = max(worst, float((ours[i, :r] - ref).abs().max()))
    return {"te": use_te(), "device": str(dev.current()), "max_abs_diff": worst,
            "tol": LOGPROB_TOL[dtype]}


def child_updates() -> dict:
    from megarl.models.setup import build_all
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    from megarl.rollout.controller.dump import read_samples

    cfg = _setup(["model.dtype=float32", "algo.kl_coef=0.01"])   # a KL term: the reference is built and compared
    samples = read_samples(str(RECORDED))
    out = {}
    for algo in ("ppo", "grpo"):
        cfg.algo.name = algo
        models = build_all(cfg)
        batch = build_batch(samples, models.tokenizer.pad_token_id)
        out[algo] = [ppo_step(cfg, models.actor, models.reference, models.critic, batch, step)
                     for step in range(2)]
    return out


def child_checkpoint(folder: str) -> dict:
    from megarl.checkpoint import manager as ckpt
    from megarl.models.setup import build_all
    from megarl.ppo import actor as actor_ops
    from megarl.ppo.batch import build_batch
    from megarl.ppo.step import ppo_step
    from megarl.rollout.controller.dump import read_samples

    cfg = _setup(["model.dtype=float32", "algo.name=ppo"])
    samples = read_samples(str(RECORDED))
    models = build_all(cfg)
    batch = build_batch(samples, models.tokenizer.pad_token_id)
    ppo_step(cfg, models.actor, models.reference, models.critic, batch, 0)
    before = actor_ops.logprobs(models.actor.model, batch, 4, models.actor.info.vocab_size)
    ckpt.save(folder, 0, models.actor, models.critic, {"step": 0}, "", keep=1)
    fresh = build_all(cfg)
    untrained = actor_ops.logprobs(fresh.actor.model, batch, 4, fresh.actor.info.vocab_size)
    ckpt.load(ckpt.complete_checkpoints(folder)[-1], fresh.actor, fresh.critic)
    after = actor_ops.logprobs(fresh.actor.model, batch, 4, fresh.actor.info.vocab_size)
    return {"max_abs_diff": float((after - before).abs().max()),
            "update_moved": float((untrained - before).abs().max())}


def child_speed(small: bool) -> dict:
    import torch
    from transformers import LlamaConfig

    from megarl.data.sample import Sample
    from megarl.distributed import device as dev
    from megarl.models.builders import build_model, make_trainable
    from megarl.models.transformer_config import transformer_config
    from megarl.ppo.step import ppo_step

    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    size = (dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8)
            if small else
            dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32))
    hf = LlamaConfig(**size, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
                     rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"])
    seqs, prompt, response = (4, 64, 64) if small else (16, 256, 768)
    cfg = _setup(["model.dtype=float32", "algo.name=ppo", f"rollout.sampling.n={seqs // 2}",
                  f"rollout.sampling.max_new_tokens={response}",
                  f"rollout.engines.max_model_len={prompt + response + 1}",
                  "train.mini_batches=1",
                  f"train.micro_batch_size={2 if small else 4}", "train.critic_warmup_steps=0"])

    def make(role):
        tcfg = transformer_config(hf, 1, 1, dtype, on_gpu)
        model, info = build_model(hf, tcfg, 128, role)
        return model.to(dev.current()), info
    actor = make_trainable(*make("actor"), 1e-6, 0.0, 1.0, 0, 10)
    critic = make_trainable(*make("critic"), 1e-6, 0.0, 1.0, 0, 10)
    reference = make("reference")[0].eval().requires_grad_(False)
    params = sum(p.numel() for p in actor.model.parameters())
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(3, 32000, (prompt,), generator=g).tolist(),
                      torch.randint(3, 32000, (response,), generator=g).tolist(),
                      [-1.0] * response, [0] * response, True, i // 2, reward=float(i % 2))
               for i in range(seqs)]
    from megarl.ppo.batch import build_batch
    batch = build_batch(samples, 0)
    times = []
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    for step in range(3):
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        ppo_step(cfg, actor, reference, critic, batch, step)
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    tokens = seqs * (prompt + response)
    step_s = min(times[1:])
    # actor and critic: forward + backward (6 flops/param/token); reference, old logprobs and
    # values: forward only (2 flops/param/token each)
    flops = (6 * 2 + 2 * 3) * params * tokens
    return {"params": params, "dtype": str(dtype).replace("torch.", ""), "sequences": seqs,
            "tokens_per_step": tokens, "step_time_s": step_s, "step_times_s": times,
            "achieved_tflops": flops / step_s / 1e12,
            "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None}


def child(name: str, out: str, args: list[str]) -> None:
    if name == "logprobs":
        result = child_logprobs(args[0])
    elif name == "updates":
        result = child_updates()
    elif name == "checkpoint":
        result = child_checkpoint(args[0])
    elif name == "speed":
        result = child_speed(args[0] == "small")
    else:
        raise SystemExit(f"unknown child {name!r}")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    from megarl.distributed import parallel
    parallel.destroy()


# ---------------------------------------------------------------- orchestration
def _run(name: str, args: list[str], out_dir: Path, cpu: bool, timeout: int) -> dict:
    out = out_dir / f"{name}{'_'.join([''] + args).replace('/', '_')}{'_cpu' if cpu else ''}.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, __file__, "--child", name, str(out), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-3)


def check(name: str, out_dir: Path, on_cpu: bool) -> tuple[bool, str, dict]:
    if name.startswith("logprobs"):
        dtype = "float32" if name.endswith("fp32") else "bfloat16"
        r = _run("logprobs", [dtype], out_dir, on_cpu, 600)
        return r["max_abs_diff"] < r["tol"], f"max |diff| {r['max_abs_diff']:.2e} (tol {r['tol']}, TE {r['te']})", r
    if name == "updates":
        here = _run("updates", [], out_dir, on_cpu, 900)
        ref = _run("updates", [], out_dir, True, 900)
        keys = ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "entropy", "kl")
        worst, where = 0.0, ""
        for algo in here:
            for step, (a, b) in enumerate(zip(here[algo], ref[algo])):
                for k in keys:
                    rel = abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1e-3)
                    if rel > worst:
                        worst, where = rel, f"{algo} step {step} {k}: {a[k]:.6g} vs cpu {b[k]:.6g}"
        ok = worst <= UPDATE_RTOL
        return ok, f"worst relative gap {worst:.2e} (rtol {UPDATE_RTOL}; {where})", {"device": here, "cpu": ref}
    if name == "checkpoint":
        with tempfile.TemporaryDirectory() as tmp:
            r = _run("checkpoint", [tmp], out_dir, on_cpu, 600)
        ok = r["max_abs_diff"] < 1e-6 and r["update_moved"] > 1e-6
        return ok, (f"logprobs after load vs before save {r['max_abs_diff']:.1e}; "
                    f"the update moved them {r['update_moved']:.1e}"), r
    if name == "speed_1b":
        r = _run("speed", ["small" if on_cpu else "full"], out_dir, on_cpu, 900)
        ok = on_cpu or r["params"] >= 1e9
        return ok, (f"{r['params'] / 1e9:.2f}B params, step {r['step_time_s']:.2f} s, "
                    f"{r['achieved_tflops']:.0f} TFLOP/s, peak {r['peak_gpu_mem_gib']} GiB"), r
    raise ValueError(f"unknown check {name!r}: choose from {CHECKS}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="device_check_out")
    p.add_argument("--only", default=",".join(CHECKS))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args()
    on_cpu = a.device == "cpu"
    if not on_cpu:
        import torch
        if not torch.cuda.is_available():
            print("FAIL setup: no CUDA GPU visible (use --device cpu for a dry run)")
            return 1
    out_dir = Path(a.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (MODEL / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--out", str(MODEL)],
                       check=True, cwd=ROOT)
    summary, t0 = {}, time.perf_counter()
    for name in a.only.split(","):
        t = time.perf_counter()
        try:
            ok, line, detail = check(name, out_dir, on_cpu)
        except Exception as err:  # noqa: BLE001 - one failing check must not hide the others
            ok, line, detail = False, f"{type(err).__name__}: {str(err)[-1500:]}", {}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {line} [{time.perf_counter() - t:.0f} s]", flush=True)
        summary[name] = {"pass": ok, "line": line, "detail": detail}
    passed = sum(v["pass"] for v in summary.values())
    print(f"SUMMARY {passed}/{len(summary)} passed in {time.perf_counter() - t0:.0f} s "
          f"({'cpu dry run' if on_cpu else 'cuda'}); details in {out_dir / 'summary.json'}")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if passed == len(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
