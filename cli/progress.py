"""The rich progress bar behind `Output.progress` (imported only when a terminal shows one)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from tqstore.config import format_size


class AmountColumn(ProgressColumn):
    """done/total in the unit (sizes for bytes)."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", self.unit)
        if task.total is None:
            return Text("")
        if unit == "bytes":
            return Text(f"{format_size(int(task.completed))}/{format_size(int(task.total))}")
        return Text(f"{int(task.completed)}/{int(task.total)}" + (f" {unit}" if unit else ""))


class RateColumn(ProgressColumn):
    """Units per second, once rich has measured a speed."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        unit, speed = task.fields.get("unit", self.unit), task.speed
        if not speed or not unit:
            return Text("")
        if unit == "bytes":
            return Text(f"{format_size(int(speed))}/s")
        return Text(f"{speed:,.0f} {unit}/s")


@contextlib.contextmanager
def progress_bar(stream: IO[str], description: str, unit: str) -> Iterator[Callable[..., None]]:
    """A transient bar on `stream`; yields update(done, total, *ignored, stage=None, unit=None):
    a new `stage` restarts the bar under that name, in `unit` if given."""
    columns = [TextColumn("{task.description}"), BarColumn(), AmountColumn(unit), RateColumn(unit),
               TimeRemainingColumn()]
    with Progress(*columns, console=Console(file=stream), transient=True) as bar:
        default_unit = unit
        task = bar.add_task(description, total=None, unit=unit)

        def update(done: int, total: int, *_: object, stage: str | None = None, unit: str | None = None) -> None:
            if stage is not None and stage != bar.tasks[0].description:
                bar.reset(task, total=total, description=stage, unit=unit if unit is not None else default_unit)
            bar.update(task, completed=done, total=total)

        yield update
