"""Textual dashboards for the hub (`echo-hub dashboard`) and the volunteer node (`echo-node join --dashboard`)."""
