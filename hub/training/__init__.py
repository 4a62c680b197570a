"""The learner and what it needs: the GRPO learner, multi-rank training, checkpoints, evaluation,
the hub's task, metrics and trackers. It knows nothing of the node protocol or HubState."""
