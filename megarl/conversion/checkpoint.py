"""Former home of the conversion code, kept so `megarl.conversion.checkpoint` imports go on
working. The code lives in: `hf_reader` (streaming HF reader), `launch` (gloo ranks),
`to_megatron`, `to_hf`, `compare` (logit comparison) and `cli`.
"""
from megarl.conversion.cli import cli_compare_logits, cli_hf_to_megatron, cli_megatron_to_hf  # noqa: F401
from megarl.conversion.compare import (compare_logits, load_megatron_actor, logit_stats,  # noqa: F401
                                       random_prompts)
from megarl.conversion.hf_reader import (INDEX_JSON, ConversionError, HFCheckpoint,  # noqa: F401
                                         check_hf_checkpoint, copy_side_files, load_hf_config)
from megarl.conversion.to_hf import DistCheckpointReader, ShardWriter, megatron_to_hf  # noqa: F401
from megarl.conversion.to_megatron import (CONVERSION_JSON, DEFAULT_DIVISIBLE_BY,  # noqa: F401
                                           HF_CONFIG_DIR, hf_to_megatron)
