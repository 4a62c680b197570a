"""Linux network namespaces for NAT tests: a public segment and home networks behind NAT routers.

    public (bridge 10.77.0.0/24: .1 the hub, and public nodes beside it)
      |-- router r1 (wan 10.77.0.11, lan 192.168.1.1, MASQUERADE) -- home h1 (192.168.1.2)
      |-- router r2 (wan 10.77.0.12, lan 192.168.2.1, MASQUERADE) -- home h2 (192.168.2.2)

Each router forwards what its home starts and silently drops what the public side starts (to the
home or to itself), as a home router does; only the addresses above exist. The namespaces are created by `Topology()` and deleted on
exit, names prefixed per process so concurrent runs do not collide. Needs root, `ip` and `iptables`
(`unavailable()` says which is missing).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from testbed import forked
from testbed.harness import HubProc, Proc, wait_until, with_model

HUB_IP = "10.77.0.1"
# Where a public node listens, in the hub's namespace: its connections to the hub come from HUB_IP (a local
# address), and the hub dials a node back only at the IP it came from, so that is where it must listen.
PUBLIC_NODE_LISTEN = "/ip4/0.0.0.0/tcp/0"
HUB_PORT = 4077
HOMES = 2


def unavailable() -> str | None:
    """Why NAT tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 iptables)"
    probe = f"e2probe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _reap_stale() -> None:
    """Delete namespaces a killed test run left behind (their creator's pid is gone)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listed:
        match = re.fullmatch(r"e2(\d+)(pub|r\d|h\d)", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")


class Topology:
    """The namespaces above; `start(ns, ...)` runs a hub or a node inside one."""

    def __init__(self) -> None:
        _reap_stale()
        tag = f"e2{os.getpid()}"
        self.public = f"{tag}pub"
        self.routers = [f"{tag}r{i}" for i in range(1, HOMES + 1)]
        self.homes = [f"{tag}h{i}" for i in range(1, HOMES + 1)]

    @property
    def namespaces(self) -> list[str]:
        return [self.public, *self.routers, *self.homes]

    def __enter__(self) -> Topology:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        pub = self.public
        _run("ip", "-n", pub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", pub, "link", "set", "br0", "up")
        _run("ip", "-n", pub, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
        for i, (router, home) in enumerate(zip(self.routers, self.homes), start=1):
            _run("ip", "link", "add", "wan", "netns", router, "type", "veth", "peer", "name", f"port{i}", "netns", pub)
            _run("ip", "-n", pub, "link", "set", f"port{i}", "master", "br0", "up")
            _run("ip", "-n", router, "addr", "add", f"10.77.0.1{i}/24", "dev", "wan")
            _run("ip", "-n", router, "link", "set", "wan", "up")
            _run("ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", home)
            _run("ip", "-n", router, "addr", "add", f"192.168.{i}.1/24", "dev", "lan")
            _run("ip", "-n", router, "link", "set", "lan", "up")
            _run("ip", "-n", home, "addr", "add", f"192.168.{i}.2/24", "dev", "eth0")
            _run("ip", "-n", home, "link", "set", "eth0", "up")
            _run("ip", "-n", home, "route", "add", "default", "via", f"192.168.{i}.1")
            inside = ("ip", "netns", "exec", router)
            _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            _run(
                *inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"192.168.{i}.0/24", "-o", "wan", "-j", "MASQUERADE"
            )
            _run(
                *inside,
                "iptables",
                "-A",
                "FORWARD",
                "-i",
                "wan",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            )
            _run(*inside, "iptables", "-A", "FORWARD", "-i", "wan", "-j", "DROP")
            # Nor does it answer what it did not ask for itself: silence, not a reset, as home routers do.
            _run(
                *inside,
                "iptables",
                "-A",
                "INPUT",
                "-i",
                "wan",
                "-m",
                "conntrack",
                "--ctstate",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            )
            _run(*inside, "iptables", "-A", "INPUT", "-i", "wan", "-j", "DROP")

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def start(self, ns: str, data_dir: Path, module: str, argv: Sequence[str]) -> Proc:
        """`python -m module *argv` inside namespace `ns` (forked: testbed/forked.py), its output in
        DATA_DIR/process.out."""
        data_dir.mkdir(parents=True, exist_ok=True)
        log = data_dir / "process.out"
        return Proc(forked.spawn(module, argv, str(log), netns=ns), log)

    def start_hub(self, hub_dir: Path, *args: str) -> HubProc:
        """`echo-hub start` on the public segment at HUB_IP (no local nodes); returns once it printed its id."""
        hub = self.start(
            self.public,
            hub_dir,
            "hub.cli.main",
            [
                "start",
                "--data-dir",
                str(hub_dir),
                "--listen",
                f"/ip4/{HUB_IP}/tcp/{HUB_PORT}",
                "--no-progress",
                "--local-nodes",
                "0",
                "--steps",
                "0",
                *args,
            ],
        )
        peer = wait_until(
            lambda: next((line.split()[1] for line in hub.output().splitlines() if line.startswith("echo-hub 12D3")), None),
            60,
            "the hub to start",
        )
        return HubProc(hub.process, hub.log, f"/ip4/{HUB_IP}/tcp/{HUB_PORT}/p2p/{peer}", hub_dir)

    def start_node(self, ns: str, data_dir: Path, listen: str, hub_addr: str, *args: str) -> Proc:
        """A recording `echo-node join` (testbed/recording_node.py) inside `ns`."""
        return self.start(
            ns,
            data_dir,
            "testbed.recording_node",
            [
                "join",
                "--hub",
                hub_addr,
                "--price",
                "0.35",
                "--backend",
                "hf",
                "--device",
                "cpu",
                "--data-dir",
                str(data_dir),
                "--listen",
                listen,
                *with_model(args),
            ],
        )
