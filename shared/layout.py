"""Names of the files and folders inside a hub's and a node's data dir.

The processes that write them (hub, node) and those that read them (dashboards, `echo-hub
status` / `report`, tests, benchmarks) share these names, so they are defined once, here.
"""

from __future__ import annotations

# A hub's data dir (`echo-hub start --data-dir`, default ./echo2-data).
HUB_KEY_FILE = "hub.key"  # the hub's Ed25519 identity: whoever holds it signs snapshots
HUB_STORE_FILE = "hub.sqlite"  # the store: nodes, leases, trajectories, steps, ledger, events
HUB_STATUS_FILE = "status.json"  # the newest HubStatus, rewritten every second
HUB_LOG_FILE = "hub.log"
METRICS_FILE = "metrics.jsonl"  # one line per learner step
REPORT_FILE = "report.png"  # `echo-hub report`'s default output
SNAPSHOTS_DIR = "snapshots"  # published snapshots (manifest + weights per version)
CHECKPOINTS_DIR = "checkpoints"  # model + optimizer every checkpoint_every steps
FINAL_DIR = "final"  # the policy at the end of a run, loadable with from_pretrained
LOCAL_NODES_DIR = "nodes"  # data dirs of the local nodes `echo-hub start` spawns

# A node's data dir (`echo-node join --data-dir`, default ./echo2-node).
NODE_KEY_FILE = "node.key"
NODE_STATUS_FILE = "node_status.json"  # the newest NodeView, rewritten every second
NODE_LOG_FILE = "node.log"
