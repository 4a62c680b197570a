"""What the hub remembers: the SQLite store and its single writer, the rollout buffer, the fleet's node
records, the lease book and the shelf of signed snapshots."""
