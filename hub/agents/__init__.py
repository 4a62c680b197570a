"""Tool-using (agentic) rollouts: the tools a run offers, the sandbox they run in, the tool-calling loop, and the
rollouts of each multi-turn lease (docs/agents.md)."""
