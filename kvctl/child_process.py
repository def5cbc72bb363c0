"""How kvctl starts a Python child of its own: the installed kvctl, whatever the working directory.

`python -m pkg` puts the working directory first on `sys.path`, so run from the folder that holds a checkout it
imports the source tree (uncompiled, perhaps another version) instead of the installed package; `-P` (3.11+)
leaves the working directory out.
"""

from __future__ import annotations

import sys


def python_module(module: str) -> list[str]:
    """argv that runs `module` with this interpreter and the kvctl it has installed."""
    return [sys.executable, "-P", "-m", module]
