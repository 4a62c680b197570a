"""The method's math, pure: the capacity model and activation (capacity), GRPO advantages and loss (grpo),
forwarding-chain planning (chains). No I/O, no state, no imports from the rest of hub/."""
