"""Subprocess body of test_plan_moe_memory: what megatron-core's DDP and distributed optimizer
hold per rank for an MoE model with expert parallelism, measured, beside what `megarl plan`
predicts for the same model and layout (megarl/plan/experts.py, memory.py).

Run under torchrun (gloo): WORLD ranks = DP (TP = PP = 1), EP from the command line. The model
is megatron's GPTModel built from the local layer spec as megarl's CPU path builds one (RMSNorm,
SwiGLU, QK norm, SequentialMLP experts), layer 0 dense and layer 1 MoE, wrapped by
`models.builders.make_trainable` (the DDP and optimizer settings of every megarl run). Nothing
runs forward: the buffers and the optimizer's shards exist once built (Adam's m and v are made
as a checkpoint load makes them). Per rank it writes the bytes of the weights and the gradient
buffers (dense and expert buffers apart) and of the optimizer state (fp32 main weights that own
their storage + m + v), measured and predicted.
usage: plan_moe_probe.py EP DTYPE OUT_JSON
"""
import json
import sys
from types import SimpleNamespace

import torch

from megarl.bootstrap import bootstrap

bootstrap()   # jit hook + CPU shim before anything imports megatron (megarl/bootstrap.py)

HIDDEN, LAYERS, HEADS, KV, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 16, 96, 128
EXPERTS, TOP_K, MOE_FFN = 8, 2, 128


def build(ep: int, dtype: torch.dtype):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV, kv_channels=HEAD_DIM,
        ffn_hidden_size=FFN, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, qk_layernorm=True, num_moe_experts=EXPERTS, moe_router_topk=TOP_K,
        moe_ffn_hidden_size=MOE_FFN, moe_layer_freq=[0, 1], moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, expert_model_parallel_size=ep, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm",
                                      qk_l2_norm=False)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    return model.to(dtype), cfg


def measure(t) -> dict:
    ddp = t.model
    w = g = 0
    for b in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        g += b.grad_data.numel() * b.grad_data.element_size()
        if b.param_data is not None:
            w += b.param_data.numel() * b.param_data.element_size()
    if not w:   # fp32 without a param buffer: the parameters themselves
        w = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    own = {p.untyped_storage().data_ptr() for p in ddp.module.parameters()}
    own |= {b.param_data.untyped_storage().data_ptr() for b in [*ddp.buffers, *ddp.expert_parallel_buffers]
            if b.param_data is not None}
    opt, seen = 0, set()
    for o in getattr(t.optimizer, "chained_optimizers", [t.optimizer]):
        if not o.optimizer.state:
            o._init_optimizer_states_with_dummy_values()
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                state = o.optimizer.state.get(p, {})
                tensors = [p] + [v for k, v in state.items() if torch.is_tensor(v) and k != "step"]
                for x in tensors:
                    ptr = x.untyped_storage().data_ptr()
                    if ptr not in own and ptr not in seen:
                        seen.add(ptr)
                        opt += x.numel() * x.element_size()
    return {"weights": w, "grads": g, "optimizer": opt}


def arch():
    from megarl.models.arch import Arch
    return Arch(hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV, head_dim=HEAD_DIM, ffn=FFN, vocab=VOCAB,
                qk_norm=True, experts=EXPERTS, top_k=TOP_K, moe_ffn=MOE_FFN, dense_layers=(0,))


def saved_by_layer(model, seq: int, mbs: int) -> list[int]:
    """Bytes autograd keeps for backward in each decoder layer during one forward of random
    tokens (saved-tensor hooks; each storage once, parameters excluded), then backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    per_layer: list[dict[int, int]] = [{} for _ in model.decoder.layers]
    current = [-1]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if current[0] >= 0 and ptr not in params:
            seen = per_layer[current[0]]
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, -1))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (mbs, seq), generator=g)
    positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, mask).float().sum().backward()
    return [sum(s.values()) for s in per_layer]


def activations(ep: int) -> dict:
    """Measured and predicted (`memory.layer_activation_bytes`, the unfused CPU path, fp32) bytes
    kept by the dense layer and the MoE layer for one micro-batch of 2 x 64 tokens."""
    from megarl.plan import memory as mem
    model, _ = build(ep, torch.float32)
    seq, mbs = 64, 2
    return {"measured": saved_by_layer(model, seq, mbs),
            "predicted": [mem.layer_activation_bytes(arch(), seq, mbs, 1, act_bytes=4, fused=False, layer=i)
                          for i in range(LAYERS)]}


def predict(ep: int, dp: int, dtype: str) -> dict:
    from megarl.plan import memory as mem
    from megarl.plan.trainer import Layout
    arch_ = arch()
    lay = Layout(1, 1, dp, ep, 1)
    dense, local_experts = mem.stage_param_split(arch_, 1, 1, 0, "actor", 128, ep, 1)
    per, per_expert = mem.trainable_bytes_per_param(dtype, dp), mem.trainable_bytes_per_param(dtype, lay.edp)
    return {k: dense * per[k] + local_experts * per_expert[k] for k in per} | {
        "dense_params": dense, "expert_params": local_experts, "edp": lay.edp}


def main(ep: int, dtype: str, out_path: str) -> None:
    import torch.distributed as dist

    from megarl.distributed import cpu, parallel
    from megarl.distributed.env import init_distributed
    from megarl.models.builders import make_trainable
    env = init_distributed("gloo")
    cpu.apply()
    torch.set_num_threads(1)
    parallel.initialize(1, 1, 0, ep=ep)
    model, cfg = build(ep, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    t = make_trainable(model, SimpleNamespace(config=cfg), lr=1e-5, weight_decay=0.0, grad_clip=1.0, warmup=0,
                       total_updates=1)
    row = {"rank": env.rank, "measured": measure(t), "predicted": predict(ep, env.world_size, dtype),
           "local_params": sum(p.numel() for p in model.parameters()), "activations": activations(ep)}
    rows = [None] * env.world_size
    dist.all_gather_object(rows, row)
    if env.rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    dist.barrier()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
