"""The rich progress bar behind `Output.progress` (imported only when a terminal shows one)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

from tqstore.units import format_size


class UnitColumn(ProgressColumn):
    """A column in the bar's unit, or in the current stage's (the task's `unit` field)."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def unit_of(self, task: Task) -> str:
        return task.fields.get("unit", self.unit)


class AmountColumn(UnitColumn):
    """done/total in the unit (sizes for bytes)."""

    def render(self, task: Task) -> Text:
        unit = self.unit_of(task)
        if task.total is None:
            return Text("")
        if unit == "bytes":
            return Text(f"{format_size(int(task.completed))}/{format_size(int(task.total))}")
        return Text(f"{int(task.completed)}/{int(task.total)}" + (f" {unit}" if unit else ""))


def average_rate(task: Task) -> float | None:
    """Units per second since the stage's first update (None before any unit is done).

    rich's own speed needs several updates inside its 30 s window; a prefill updates once per
    512-token chunk, often less than once a minute on a CPU, so its rate and ETA stayed blank.
    """
    start, base = task.fields.get("since"), task.fields.get("base", 0)
    if start is None or task.completed <= base:
        return None
    elapsed = task.get_time() - start
    return (task.completed - base) / elapsed if elapsed > 0 else None


class RateColumn(UnitColumn):
    """Units per second, from the first finished chunk on."""

    def render(self, task: Task) -> Text:
        unit, speed = self.unit_of(task), average_rate(task)
        if not speed or not unit:
            return Text("")
        if unit == "bytes":
            return Text(f"{format_size(int(speed))}/s")
        return Text(f"{speed:,.1f} {unit}/s" if speed < 10 else f"{speed:,.0f} {unit}/s")


class EtaColumn(ProgressColumn):
    """Time left at the average rate so far (blank until one chunk is done)."""

    def render(self, task: Task) -> Text:
        speed = average_rate(task)
        if not speed or task.total is None:
            return Text("")
        left = max(task.total - task.completed, 0) / speed
        minutes, seconds = divmod(round(left), 60)
        return Text(f"ETA {minutes // 60}:{minutes % 60:02d}:{seconds:02d}", style="progress.remaining")


@contextlib.contextmanager
def progress_bar(stream: IO[str], description: str, unit: str,
                 clock: Callable[[], float] = time.monotonic) -> Iterator[Callable[..., None]]:
    """A transient bar on `stream`; yields update(done, total, *ignored, stage=None, unit=None):
    a new `stage` restarts the bar under that name, in `unit` if given. Rate and ETA count from a
    stage's first update (a caller reports (0, total) before its first chunk); `update.task()` is
    the rich Task the columns render."""
    columns = [TextColumn("{task.description}"), BarColumn(), AmountColumn(unit), RateColumn(unit), EtaColumn()]
    with Progress(*columns, console=Console(file=stream), transient=True, get_time=clock) as bar:
        default_unit = unit
        task = bar.add_task(description, total=None, unit=unit)

        def update(done: int, total: int, *_: object, stage: str | None = None, unit: str | None = None) -> None:
            if stage is not None and stage != bar.tasks[0].description:
                bar.reset(task, total=total, description=stage, unit=unit if unit is not None else default_unit,
                          since=None)
            if bar.tasks[0].fields.get("since") is None:
                bar.update(task, since=clock(), base=done)
            bar.update(task, completed=done, total=total)

        update.task = lambda: bar.tasks[0]  # the figures the columns render
        yield update
