"""mlx-lm's package without its `__init__` until something asks the package itself.

mlx-lm's `__init__` imports `convert`, `generate` and `utils`, which import transformers at
module level (`tokenizer_utils`): 1.0 s of CPU on a 2-core x86 machine, 1.9 s of wall on the
H200, paid by every process that imports any mlx-lm module, `mlx_lm.models.cache` included.
What a restore and an answer need (a family's model module, the caches, the sampler) imports
none of that. `install()` registers the package with its search path but runs its `__init__`
only on the first attribute read from the package object (`mlx_lm.load`, `from mlx_lm import
stream_generate`), through a module `__getattr__` (PEP 562): submodules load as usual, and code
that needs the whole package gets it, unchanged, when it asks.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from types import ModuleType

PACKAGE = "mlx_lm"
_lock = threading.RLock()


def install() -> bool:
    """Register mlx-lm's package lazily unless it is imported already (or absent); whether it
    is lazy now."""
    with _lock:
        if PACKAGE in sys.modules:
            return is_lazy()
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return False
        package = importlib.util.module_from_spec(spec)

        def __getattr__(name: str) -> object:
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(_complete(package), name)

        package.__getattr__ = __getattr__  # type: ignore[attr-defined]
        sys.modules[PACKAGE] = package
        # The version (read into the plan verdicts' fingerprint) without the rest.
        package.__version__ = importlib.import_module(f"{PACKAGE}._version").__version__  # type: ignore[attr-defined]
        return True


def is_lazy() -> bool:
    """Whether mlx-lm's package is registered and its `__init__` has not run."""
    package = sys.modules.get(PACKAGE)
    return package is not None and "__getattr__" in vars(package)


def _complete(package: ModuleType) -> ModuleType:
    """Run the package's `__init__` in its module object (once)."""
    with _lock:
        if "__getattr__" in vars(package):
            del package.__getattr__
            package.__spec__.loader.exec_module(package)
    return package
