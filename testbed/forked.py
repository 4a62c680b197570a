"""Hub and node processes for integration tests, forked from one server that imported them once.

`echo-hub start` and `echo-node join` each spend 8-12 CPU-seconds importing torch, transformers and
libp2p before they do anything, and the integration tests start about a hundred of them: on 2 cores
that would be a third of the suite's time. `spawn(module, argv, out)` runs `module.main(argv)` in a process forked
from multiprocessing's forkserver (preloaded with those imports), writing stdout and stderr to `out`,
and returns an object that answers like `subprocess.Popen`. The process is otherwise the command line's:
its own pid, argv, environment, signal handlers and exit code, and its atexit handlers run on exit.
Tests of the command line itself (--help, mistakes, first contact) still start real interpreters.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import importlib
import multiprocessing
import multiprocessing.util  # registers its exit function before ours below, so ours runs first
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

from shared.logs import capture_output

PRELOAD = (
    "hub.cli.main",
    "hub.cli.run",
    "hub.training.loop",
    "hub.service.handlers",
    "hub.cli.local_nodes",
    "node.cli",
    "node.run",
    "node.hf_engine",
    "libp2p",
    "transformers.models.qwen2.modeling_qwen2",
)
_CONTEXT = multiprocessing.get_context("forkserver")
CLONE_NEWNET = 0x40000000
_started: list[Forked] = []


class Forked:
    """The parts of `subprocess.Popen` the tests use, for a process forked by the server."""

    def __init__(self, process: BaseProcess, args: Sequence[str]) -> None:
        self._process = process
        self.args = list(args)

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _enter_netns(name: str) -> None:
    """Join network namespace `name` (as `ip netns exec` does; Python 3.11 has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _main(module: str, argv: list[str], out_path: str, env: dict[str, str], netns: str | None, nice: int) -> None:
    # Before any thread starts: Linux keeps a nice value per thread, and new threads inherit it.
    os.nice(nice)
    if netns is not None:
        _enter_netns(netns)
    capture_output(Path(out_path))
    # A process the harness finds hung gets SIGABRT before SIGKILL: every thread's stack lands in its output.
    faulthandler.enable(file=sys.stderr)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    try:
        code = importlib.import_module(module).main(argv)
    finally:
        atexit._run_exitfuncs()  # a forked multiprocessing child leaves with os._exit, which skips them
    sys.exit(code)


def spawn(
    module: str, argv: Sequence[str], out_path: str, env: Mapping[str, str] | None = None, netns: str | None = None, nice: int = 0
) -> Forked:
    """`python -m module *argv` with stdout and stderr appended to `out_path`, forked from the server; inside
    network namespace `netns` when given, at CPU priority `nice` (added to the server's)."""
    _CONTEXT.set_forkserver_preload(list(PRELOAD))
    # Not daemonic: a hub forks its local nodes, and multiprocessing refuses children to a daemon.
    process = _CONTEXT.Process(target=_main, args=(module, list(argv), out_path, dict(env or os.environ), netns, nice))
    process.start()
    forked = Forked(process, [sys.executable, "-m", module, *argv])
    _started.append(forked)
    return forked


@atexit.register
def _kill_leftovers() -> None:
    """Registered after multiprocessing's own exit function, so it runs first: that one would wait for
    every non-daemonic child a failed test left running."""
    for forked in _started:
        forked.kill()
