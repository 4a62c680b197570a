"""Who works: the closed-loop scheduler that sizes the active fleet with the capacity model."""
