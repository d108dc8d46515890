"""The entry point of the ``transformer-pde`` command.

``transformer-pde --version`` (or ``-V``) is answered here without importing the library (and so
torch, which takes seconds): the version is read from the package's source.  Every other command
is handed to :func:`transformer_pde.application.cli.main`.  This module sits outside the package
because importing anything inside ``transformer_pde`` runs the package's ``__init__``, which
imports torch.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

__all__ = ["main", "version"]


def version() -> str:
    """``transformer_pde.__version__``, read from the package's ``__init__.py`` without importing it."""
    spec = importlib.util.find_spec("transformer_pde")  # finds the package; runs none of its code
    if spec is not None and spec.origin:
        try:
            text = Path(spec.origin).read_text(encoding="utf-8")
        except OSError:
            text = ""
        found = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
        if found:
            return found.group(1)
    import transformer_pde  # an unusual install: ask the package itself

    return transformer_pde.__version__


def main(argv=None) -> int:
    """Run the command line: ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["--version"], ["-V"]):
        print(f"transformer-pde {version()}")
        return 0
    from transformer_pde.application.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
