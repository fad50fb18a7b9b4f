"""fagen's version: the one place it is written (pyproject's [tool.hatch.version] reads it here).

Modules import it from here, never from the package's `__init__` (the front door, which stands
above every module: a module that imports it reaches the whole package)."""

__version__ = "0.1.0"
