"""Process launch (torchrun / SLURM / single process), megatron parallel state, CPU shim."""
