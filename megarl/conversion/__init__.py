"""The checkpoint conversion tools: HF <-> megatron dist checkpoint, and a logits check.

They sit above `megarl.models` (they build the trainer's GPTModel and load it with its own
loader) and read and map weights with `megarl.formats`. `to_megatron` / `to_hf` are the
converters, `output` prepares their output folders, `launch` starts their gloo ranks,
`compare` checks logits, `cli` holds the tools/ entry points.
"""
