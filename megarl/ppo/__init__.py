"""PPO/GRPO math: advantages, losses, behaviour-policy correction, loss aggregation."""
