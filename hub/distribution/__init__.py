"""How a snapshot reaches the fleet: the broadcaster that plans chains and streams chunks, and the
reachability checks (dial-backs, relay admission) it plans around."""
