"""The operator's commands (`echo-hub start|status|eval|plan|report`) and the composition root that
builds and runs a hub (run), with its preflight checks, progress and summary."""
