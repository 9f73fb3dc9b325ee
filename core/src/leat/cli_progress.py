"""Progress of the CLI's long jobs on stderr: a bar on a terminal, plain lines elsewhere (logs, pipes, CI)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from leat.pull import Progress


def say(text: str) -> None:
    """One progress line on stderr, flushed at once so a log shows it while the job runs."""
    click.echo(text, err=True)
    sys.stderr.flush()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def plain_lines(every: float = 5.0, clock: Callable[[], float] = time.monotonic) -> Progress:
    """Transfer progress as a line per file at most every ``every`` seconds, and one when it completes."""
    last: dict[str, float] = {}

    def update(done: int, total: int, label: str) -> None:
        now = clock()
        finished = bool(total) and done >= total
        if label in last and not finished and now - last[label] < every:
            return
        if finished and last.get(label) == float("inf"):
            return
        last[label] = float("inf") if finished else now
        share = f" ({100 * done / total:.0f}%)" if total else ""
        say(f"{label}: {_mib(done)}" + (f" of {_mib(total)}" if total else "") + share)

    return update


def bar() -> Progress:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    progress = Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn()
    )
    tasks: dict[str, Any] = {}

    def update(done: int, total: int, label: str) -> None:
        if not progress.live.is_started:
            progress.start()
        if label not in tasks:
            tasks[label] = progress.add_task(label, total=total or None)
        progress.update(tasks[label], completed=done, total=total or None)
        if total and done >= total and all(t.finished for t in progress.tasks):
            progress.stop()

    return update


def transfer() -> Progress:
    """The progress callback for a pull: a bar when stderr is a terminal, else plain lines."""
    return bar() if sys.stderr.isatty() else plain_lines()
