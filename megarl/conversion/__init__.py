"""HF <-> megatron-core parameter names and layouts, and the checkpoint converters.

`ops` holds pure shard/merge tensor functions (no process groups, no megatron imports);
`mapping` holds one declarative table per architecture and applies the ops. Both the
trainer -> vLLM weight sync and the checkpoint conversion tools use them.
`hf_reader` is the project's one HF safetensors reader (lazy, per tensor or slice; also used by
the trainer's `megarl.models.loading`); `dist_reader` reads a megatron dist checkpoint's global
tensors and names a converted folder's parts (both below the converters and the trainer's
loading, so their imports run one way); `to_megatron` / `to_hf` are the converters, `launch`
starts their gloo ranks, `compare` checks logits, `cli` holds the tools/ entry points.
"""
