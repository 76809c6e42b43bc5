"""Whether the process a zygote serves still runs, and leaving when it does not.

:mod:`qualify.candidate.zygote` ends when the process it serves (its parent, or a pool's
owner) is gone: :func:`alive_check` is that check, :func:`exit_when_gone` applies it while
the zygote is still importing, before its loop (which checks it every poll) runs.

Importing this module imports neither torch nor any engine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

THREAD_EXIT_S: Final = 2.0
"""The longest :func:`exit_when_gone` waits for its watcher's OS thread to be gone."""


def alive_check(owner: int) -> Callable[[], bool]:
    """A check that ``owner`` still runs.

    ``getppid`` when it is this process's parent (no pid reuse can fool it), else its pid
    with the start time it has now (:mod:`psutil`).
    """
    if owner == os.getppid():
        return lambda: os.getppid() == owner
    import psutil

    try:
        born = psutil.Process(owner).create_time()
    except psutil.Error:
        return lambda: False

    def alive() -> bool:
        try:
            proc = psutil.Process(owner)
            return proc.create_time() == born and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    return alive


@contextlib.contextmanager
def exit_when_gone(owner_alive: Callable[[], bool] | None, workdir: Path, *,
                   poll_s: float) -> Iterator[None]:
    """Exit this process (code 0), ``workdir`` removed, if its owner is gone meanwhile.

    A zygote started ahead of its launches (:func:`qualify.candidate.launch.prestart`) may
    still be importing when the process it serves is killed; a watcher thread checks every
    ``poll_s`` seconds and exits at once, so no zygote outlives its owner by its import time.
    ``None``: no owner, no watcher. At the block's end the thread is joined and then waited
    for until the kernel has removed it (``/proc/self/task``; ``join`` returns while the OS
    thread may still be exiting, and :func:`qualify.candidate.warm.fork_safe` would count
    it), so the zygote forks with one thread.
    """
    if owner_alive is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if not owner_alive():  # nobody is left to clean up after it
                shutil.rmtree(workdir, ignore_errors=True)
                os._exit(0)

    watcher = threading.Thread(target=watch, name="qualify-zygote-owner", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        task = Path(f"/proc/self/task/{watcher.native_id}")
        deadline = time.monotonic() + THREAD_EXIT_S
        while task.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
