"""Tools and a TRL-style environment written as TRL's docs write them, some hostile to the machine they run on
(an endless loop, 10 GiB, a socket, an endless sleep): what the tool sandbox and tool-loop tests run."""

import socket
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def spin(n: int) -> int:
    """Count forever.

    Args:
        n: Where to start.
    """
    while True:
        n += 1


def hog(gib: int) -> int:
    """Hold some memory.

    Args:
        gib: How many GiB.
    """
    return len(bytearray(gib * 1024**3))


def dial(host: str) -> str:
    """Fetch a page, or say that it could not.

    Args:
        host: Where from.
    """
    try:
        socket.create_connection((host, 80), timeout=1)
    except Exception as exc:
        return f"no page: {exc}"
    return "a page"


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def shout(n: int) -> str:
    """Say a lot.

    Args:
        n: How many characters.
    """
    return "a" * n


class Counter:
    def __init__(self):
        self.count = 0

    def reset(self, start: int = 0, **row) -> str:
        self.count = start
        return f"counter at {start}"

    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much.
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == 3)


def said_done(completions, **kwargs) -> list[float]:
    """A TRL reward function: 1.0 for a rollout whose last assistant message says it is done."""
    return [float(c[-1]["content"].strip().endswith("done")) for c in completions]


def tool_answers(completions, **kwargs) -> list[float]:
    """A TRL reward function reading a tool-using conversation as TRL passes it: the tool messages it holds."""
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]


class Dice:
    """An environment whose reset() answers each instance otherwise: rollouts that cannot share one prompt."""

    made = 0

    def __init__(self):
        Dice.made += 1
        self.face = Dice.made

    def reset(self, **row) -> str:
        return f"you rolled {self.face}"

    def roll(self) -> int:
        """Roll again.

        Returns:
            The face.
        """
        return self.face
