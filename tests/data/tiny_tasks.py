"""Task classes for tests/test_tasks.py's "module.path:ClassName" loading cases."""

from __future__ import annotations

from shared.tasks.base import Prompt, Task


class EchoTask(Task):
    """One prompt; reward 1.0 iff the completion repeats it."""

    name = "echo"

    def prompts(self) -> list[Prompt]:
        return [Prompt(id="echo-0", text="hello")]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if completion == prompt.text else 0.0


class NeedsArgsTask(EchoTask):
    def __init__(self, size: int) -> None:
        self.size = size


class AbstractTask(Task):
    def prompts(self) -> list[Prompt]:
        return []


class NotATask:
    pass


NOT_A_CLASS = 3
