"""What the hub believes of a peer: admission and rate limits (guard), submission checks (submissions),
probation audits by recomputation (audit), and copied-rollout detection (copies)."""
