"""`python -m tqstore_cli`: the same as the `tqstore` console script."""

from .main import run

run()
