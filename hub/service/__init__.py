"""The running hub's one owner of state (HubState) and the node protocol's handlers around it, the
status frame, and the hub's own local rollouts."""
