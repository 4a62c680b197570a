"""Textual dashboards for the hub (`echo-hub dashboard`) and the volunteer node (`echo-node join --dashboard`)."""

DEFAULT_REFRESH_S = 1.0
