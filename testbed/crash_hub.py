"""Helper for tests/test_crash.py: the learner + local rollouts on a data dir, as a killable process.

Usage: python testbed/crash_hub.py DATA_DIR STEPS
After construction (model loaded, buffer refilled from the store) it writes the buffer's row
ids to DATA_DIR/refill-<pid>.json, then trains until step STEPS. It prints "STEP n" after
each committed step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import trio

from hub.cli.build import build_hub_state
from hub.config import HubConfig, LearnerConfig
from hub.records.snapshots import SnapshotShelf
from hub.service.local_rollouts import LocalRollouts
from hub.training.loop import LearnerComponent
from node.hf_engine import HFEngine
from shared.crypto import Identity
from shared.default_model import ensure_default_model
from shared.layout import HUB_KEY_FILE
from shared.model_identity import load_model_identity
from shared.rollout import SamplingParams

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10)
CONFIG = LearnerConfig(staleness=3, prompts_per_step=4, group_size=4, lr=3e-4, checkpoint_every=2)


def main() -> None:
    data_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    model_dir = ensure_default_model(progress=False)
    # Built as `echo-hub start` builds it (the default task: reverse); its shelf stays empty, as no service runs.
    config = HubConfig(learner=CONFIG, sampling=SAMPLING, data_dir=data_dir)
    # The learner below keeps the window leases read in the state's measurements, as `echo-hub start`'s does.
    model = load_model_identity(model_dir)
    core = build_hub_state(config, model, SnapshotShelf(keep=CONFIG.staleness + 1))
    state = core.state
    send, receive = trio.open_memory_channel(64)
    learner = LearnerComponent(
        CONFIG, SAMPLING, model, data_dir, state, Identity.load_or_create(data_dir / HUB_KEY_FILE), send, steps, 1 << 20
    )
    (data_dir / f"refill-{os.getpid()}.json").write_text(json.dumps(state.buffer.row_ids()))
    rollouts = LocalRollouts(
        HFEngine(model_dir),
        core.task,
        SAMPLING,
        CONFIG.group_size,
        state,
        receive,
        learner.min_useful_version,
        prompts_per_batch=4,
        max_pending_groups=12,
    )

    async def report() -> None:
        seen = learner.step
        while True:
            await trio.sleep(0.01)
            if learner.step != seen:
                seen = learner.step
                print(f"STEP {seen}", flush=True)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rollouts.run)
            nursery.start_soon(report)
            await learner.run()
            nursery.cancel_scope.cancel()

    trio.run(run)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
