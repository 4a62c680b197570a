"""Atomic file writes (shared/files.py)."""

from __future__ import annotations

import threading

from shared.files import atomic_write_text


def test_two_threads_replacing_one_file_never_lose_each_others_temp_file(tmp_path):
    """What the hub does with status.json: its status board and its final refresh write from two threads."""
    path = tmp_path / "status.json"
    errors: list[BaseException] = []

    def write(text: str) -> None:
        try:
            for _ in range(300):
                atomic_write_text(path, text)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(text * 20_000,)) for text in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert path.read_text() in ("a" * 20_000, "b" * 20_000)
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temp file left behind
