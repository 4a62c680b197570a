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
HUB_LOCK_FILE = "hub.lock"  # flock'd by the running hub, holds its pid (shared/lock.py)
METRICS_FILE = "metrics.jsonl"  # one line per learner step
REPORT_FILE = "report.png"  # `echo-hub report`'s default output
SNAPSHOTS_DIR = "snapshots"  # published snapshots (manifest + weights per version)
CHECKPOINTS_DIR = "checkpoints"  # model + optimizer every checkpoint_every steps
FINAL_DIR = "final"  # the policy at the end of a run, loadable with from_pretrained
RUN_CONFIG_FILE = "echo2.toml"  # in final/ and each checkpoint: the run's whole config, as `--config` takes it
MODEL_CARD_FILE = "README.md"  # in final/ and each checkpoint: model, task, steps, rewards, evaluation
LOCAL_NODES_DIR = "nodes"  # data dirs of the local nodes `echo-hub start` spawns

# A node's data dir (`echo-node join --data-dir`, default ./echo2-node).
NODE_KEY_FILE = "node.key"
NODE_STATUS_FILE = "node_status.json"  # the newest NodeView, rewritten every second
NODE_LOG_FILE = "node.log"
NODE_MODEL_DIR = "hub-model"  # the hub's config and tokenizer files, for a node started without --model (pruned: ours alone)
NODE_LOCK_FILE = "node.lock"  # flock'd by the running node, holds its pid (shared/lock.py)
