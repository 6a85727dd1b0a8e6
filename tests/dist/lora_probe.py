"""Subprocess body of test_lora_parity: LoRA layers (megarl/models/lora.py) at TP=2 and a tiny
GPTModel with adapters at PP=2, on gloo, written out for the test to compare.

usage: torchrun --nproc_per_node=2 lora_probe.py OUT_JSON
Cases (every rank runs every case; rank 0 writes):
- tp2 / tp2_swapped: a column- and a row-parallel layer with full-size base weights and adapters
  set from seeded full tensors (each rank keeping its shard), a forward and a backward of
  sum(out * G); outputs, the adapters' and the input's gradients gathered over TP. In
  tp2_swapped rank 0 holds rank 1's adapter shard and rank 1 rank 0's (column: B, row: A).
- ref: the same in plain torch on full tensors in this process (the single-process reference),
  and the same again in other reduction orders (2 threads; the input dimension summed in two
  halves as the row layer's TP=2 does; (B A) x for B (A x)): the fp32 noise.
- pp1 / pp2: logits of a 2-layer GPTModel with apply_lora and B set from the same seeded full
  tensors, at PP=1 (DP=2) and split over 2 stages (the weights the PP=1 model drew); pp1_base:
  the PP=1 model's logits under adapters_disabled.
"""
import json
import sys

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

IN, OUT, R, ALPHA, S, B = 32, 48, 4, 8.0, 6, 2


def full(shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def tensors():
    """The full-size weights every case and the reference share (seeded: the same on every rank)."""
    t = {}
    for i, kind in enumerate(("column", "row")):
        t[kind] = dict(w=full((OUT, IN), 10 + i, IN ** -0.5), b=full((OUT,), 20 + i, 0.1),
                       a=full((R, IN), 30 + i, IN ** -0.5), lb=full((OUT, R), 40 + i, 0.3),
                       x=full((S, B, IN), 50 + i), g=full((S, B, OUT), 60 + i))
    return t


def gather(t, dim):
    from megarl.distributed import parallel
    parts = [torch.empty_like(t) for _ in range(parallel.tp_size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim)


def swap_halves(t, dim):
    a, b = t.chunk(2, dim)
    return torch.cat([b, a], dim)


def layer(kind, t, swapped):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.distributed import parallel
    from megarl.models.lora import LoRALinear, shard
    cfg = TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, gradient_accumulation_fusion=False,
                            tensor_model_parallel_size=parallel.tp_size())
    tp, rank = parallel.tp_size(), parallel.tp_rank()
    if kind == "column":
        base = ColumnParallelLinear(IN, OUT, config=cfg, init_method=torch.nn.init.zeros_, bias=True)
        w, bias = shard(t["w"], 0, rank, tp), shard(t["b"], 0, rank, tp)
    else:
        base = RowParallelLinear(IN, OUT, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                 input_is_parallel=True, skip_bias_add=False)
        w, bias = shard(t["w"], 1, rank, tp), t["b"]
    with torch.no_grad():
        base.weight.copy_(w)
        base.bias.copy_(bias)
    lora = LoRALinear(base, R, ALPHA, 0.0, seed=0)
    a, lb = t["a"], t["lb"]
    if swapped:   # rank 0 gets rank 1's shard of the split adapter and the other way round
        a, lb = (a, swap_halves(lb, 0)) if kind == "column" else (swap_halves(a, 1), lb)
    lora.set_full(a, lb)
    return lora


def tp_case(t, swapped=False):
    from megarl.distributed import parallel
    out = {}
    for kind in ("column", "row"):
        m, d = layer(kind, t[kind], swapped), t[kind]
        x = d["x"].clone() if kind == "column" else d["x"].chunk(parallel.tp_size(), -1)[parallel.tp_rank()].clone()
        x.requires_grad_()
        y, _ = m(x)
        g = d["g"] if kind == "row" else d["g"].chunk(parallel.tp_size(), -1)[parallel.tp_rank()]
        (y * g).sum().backward()
        if kind == "column":
            res = dict(out=gather(y, -1), da=m.lora_a.grad, db=gather(m.lora_b.grad, 0), dx=x.grad)
            same = [gather(m.lora_a.grad.unsqueeze(0), 0), gather(x.grad.unsqueeze(0), 0)]
        else:
            res = dict(out=y, da=gather(m.lora_a.grad, 1), db=m.lora_b.grad, dx=gather(x.grad, -1))
            same = [gather(m.lora_b.grad.unsqueeze(0), 0), gather(y.unsqueeze(0), 0)]
        # a replicated result must be the same on every TP rank, bitwise
        res["replicas_agree"] = all(bool((s == s[0]).all()) for s in same)
        out[kind] = {k: v.tolist() if torch.is_tensor(v) else v for k, v in res.items()}
    return out


def reference(t, order="plain"):
    """The single-process reference: y = x W^T + b + (alpha/r) (x A^T) B^T and its gradients by
    autograd, on full tensors; `order` recomputes it in another reduction order (the noise)."""
    out = {}
    for kind in ("column", "row"):
        d = {k: v.clone().requires_grad_() for k, v in t[kind].items()}
        x, w, a, lb = d["x"], d["w"], d["a"], d["lb"]
        if order == "halves":   # the input dimension summed in two halves, as the TP=2 row layer does
            xs, ws, as_ = x.chunk(2, -1), w.chunk(2, 1), a.chunk(2, 1)
            base = xs[0] @ ws[0].t() + xs[1] @ ws[1].t()
            h = xs[0] @ as_[0].t() + xs[1] @ as_[1].t()
            y = base + d["b"] + (ALPHA / R) * h @ lb.t()
        elif order == "assoc":  # (B A) x instead of B (A x)
            y = x @ w.t() + d["b"] + (ALPHA / R) * x @ (lb @ a).t()
        else:
            y = x @ w.t() + d["b"] + (ALPHA / R) * (x @ a.t()) @ lb.t()
        (y * d["g"]).sum().backward()
        out[kind] = dict(out=y.tolist(), da=a.grad.tolist(), db=lb.grad.tolist(), dx=x.grad.tolist())
    return out


def gpt_logits(lora_cfg, state=None):
    """Logits of the tiny GPTModel (this PP stage's), adapters applied and B set from seeded full
    tensors by global layer; `state`: the PP=1 model's weights to load (None: keep this init)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.distributed import parallel
    from megarl.models.lora import LoRALinear, adapters_disabled, apply_lora
    from megarl.models.masks import causal_mask
    pp = parallel.pp_size()
    cfg = TransformerConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                            use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
                            attention_dropout=0.0, gradient_accumulation_fusion=False, add_bias_linear=False,
                            normalization="RMSNorm", gated_linear_unit=True, pipeline_model_parallel_size=pp,
                            pipeline_dtype=torch.float32)
    torch.manual_seed(0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=64, max_sequence_length=16, pre_process=parallel.is_first_stage(),
                     post_process=parallel.is_last_stage(), position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    if state is not None:   # the PP=1 weights, layers renumbered to this stage's
        off = parallel.pp_rank() * (2 // pp)
        mine = {}
        for k, v in state.items():
            if k.startswith("decoder.layers."):
                i, rest = k[len("decoder.layers."):].split(".", 1)
                k = f"decoder.layers.{int(i) - off}.{rest}"
            mine[k] = torch.tensor(v)
        own = model.state_dict()
        missing = [k for k in own if not k.endswith("_extra_state") and k not in mine]
        assert not missing, missing
        model.load_state_dict({k: mine[k] for k in own if k in mine}, strict=False)
    plain = {k: v.tolist() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    apply_lora(model, lora_cfg)
    for layer in model.decoder.layers:
        for name, m in layer.named_modules():
            if isinstance(m, LoRALinear):
                n = layer.layer_number * 100 + sum(map(ord, name))
                b_full = full((m.output_size, lora_cfg.rank), n, 0.2)
                m.set_full(m.lora_a.detach().clone(), b_full)   # TP=1: A is whole
    model.eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pos, mask = torch.arange(8).expand(2, 8), causal_mask(8, ids.device)
    with torch.no_grad():
        if pp == 1:   # and the base's logits (adapters off), which B must move
            with adapters_disabled(model):
                base = model(ids, pos, mask)
            return (model(ids, pos, mask), base), plain
        if parallel.is_first_stage():
            hidden = model(ids, pos, mask)
            torch.distributed.send(hidden.contiguous(), dst=1)
            return None, plain
        hidden = torch.empty(8, 2, 32)
        torch.distributed.recv(hidden, src=0)
        model.set_input_tensor(hidden)
        return model(None, pos, mask), plain


def main(out_path: str) -> None:
    from megarl.config.schema import LoraConfig
    from megarl.distributed import parallel
    from megarl.distributed.env import init_distributed
    init_distributed("gloo")
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    t = tensors()
    result = {}
    parallel.initialize(2, 1, seed=0)
    result["tp2"] = tp_case(t)
    result["tp2_swapped"] = tp_case(t, swapped=True)
    result["ref"] = reference(t)
    result["ref_halves"] = reference(t, "halves")
    result["ref_assoc"] = reference(t, "assoc")
    torch.set_num_threads(2)
    result["ref_threads2"] = reference(t)
    torch.set_num_threads(1)
    lora_cfg = LoraConfig(rank=R, alpha=ALPHA, targets=["qkv", "proj", "fc1", "fc2"], seed=5)
    parallel.initialize(1, 1, seed=0)
    (pp1, base), state = gpt_logits(lora_cfg)
    result["pp1"], result["pp1_base"] = pp1.tolist(), base.tolist()
    parallel.initialize(1, 2, seed=0)
    pp2, _ = gpt_logits(lora_cfg, state)
    if rank == 1:   # the last stage's logits to rank 0, which writes
        torch.distributed.send(pp2.contiguous(), dst=0)
    elif rank == 0:
        got = torch.empty_like(pp1)
        torch.distributed.recv(got, src=1)
        result["pp2"] = got.tolist()
        with open(out_path, "w") as f:
            json.dump(result, f)
    parallel.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
