"""The processes below a process, from /proc: what to kill when a run that started servers is stopped.

A process group is not enough: a benchmark or a test may start a server in a session of its own (`serve run`,
so that Ctrl-C reaches it alone), and Ray's processes are children of the driver that started them. Parent
links reach all of them as long as their parent is alive, so the tree is read before anything is killed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(root: int | None = None) -> set[int]:
    """The pids of every process below `root` (this process by default)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])  # after "(comm)": the state, then the parent's pid
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [os.getpid() if root is None else root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill(pids: set[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # gone already
            pass
