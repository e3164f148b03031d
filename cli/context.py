"""What one command run shares: the parsed flags, the output, and the Store and Engine it opens.

The Store and the Engine are opened on first use (MLX and mlx-lm load only for commands that
need a model) and closed when the run ends, so in-process callers (tests) can run many commands
one after the other.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tqstore.config import Config, load_config, resolve_home

from .output import Output

if TYPE_CHECKING:
    from tqstore.engine.engine import Engine
    from tqstore.store.store import Store


class Context:
    """The flags, output, config and lazily opened Store/Engine of one command run."""

    def __init__(self, args: argparse.Namespace, out: Output, keep: list[object] | None = None) -> None:
        self.args = args
        self.out = out
        self.keep = keep
        self._config: Config | None = None
        self._store: Store | None = None
        self._engine: Engine | None = None

    @property
    def home(self) -> Path:
        """The home folder: --home, else $TQSTORE_HOME, else ~/.cache/tqstore."""
        return resolve_home(self.args.home)

    @property
    def config(self) -> Config:
        """The effective configuration of the home (file < environment)."""
        if self._config is None:
            self._config = load_config(self.args.home)
        return self._config

    def store(self) -> Store:
        """The home's Store, opened once per run."""
        if self._store is None:
            from tqstore.store.store import Store

            self._store = Store.open(config=self.config)
        return self._store

    def engine(self) -> Engine:
        """An Engine over the home's Store (models load on first use)."""
        if self._engine is None:
            from tqstore.engine.engine import Engine

            self._engine = Engine(self.store(), light=True)
        return self._engine

    def close(self) -> None:
        """Close what this run opened. The Engine (and the models it loaded) goes to `keep` when
        one was given: the console script ends with os._exit, and freeing a model's arrays first
        only costs time (0.7 s of a fresh `ask` with a 0.5B model on a 2-core CPU)."""
        if self._store is not None:
            self._store.close()
            if self.keep is not None and self._engine is not None:
                self.keep.append(self._engine)
            self._store = None
            self._engine = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
