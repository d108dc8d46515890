"""Build the documentation site in one command, warnings as errors, and check it as a reader would.

    pip install -e ".[docs]"           # Sphinx, sphinx-gallery, MyST, furo
    python scripts/build_docs.py       # -> docs/_build/html/index.html

Steps:

1. ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` — the API reference is
   generated from the docstrings (``docs/apigen.py``) and every ``docs/gallery/plot_*.py`` is
   executed (sphinx-gallery); any warning fails the build.
2. A check of the HTML: every local ``href``/``src`` (links, images, scripts, stylesheets) must
   name a file of the build, and every ``#anchor`` of a local link an ``id`` in its target page.
   Broken links and missing images fail the build.
3. The run time of every gallery example (from sphinx-gallery's record), and the total; with
   ``--max-example-seconds S`` an example slower than S fails the build (off by default: the
   time depends on the machine and its load, so it is reported, not asserted).
4. ``--screenshots``: ``scripts/docs_screenshots.py`` renders pages in headless Chromium.

``--clean`` removes the previous build and the generated sources first (a clean-checkout build).
"""

from __future__ import annotations

import argparse
import html.parser
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OUT = DOCS / "_build" / "html"
GENERATED = [DOCS / "_build", DOCS / "api", DOCS / "auto_examples", DOCS / "sg_execution_times.rst"]


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) and not (tag == "a" and key == "src"):
                self.refs.append((tag, a[key]))


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    return p


def check_links(out: Path = OUT) -> list[str]:
    """Every local href/src of every HTML page must exist (and its #anchor too); the problems."""
    pages = sorted(out.rglob("*.html"))
    parsed = {p: _parse(p) for p in pages}
    problems = []
    for page, links in parsed.items():
        for tag, ref in links.refs:
            parts = urlsplit(ref)
            if parts.scheme or parts.netloc or ref.startswith(("mailto:", "javascript:", "data:")):
                continue  # external: not checked (no network)
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(f"{page.relative_to(out)}: <{tag}> {ref!r}: {target.relative_to(out.resolve()) if target.is_relative_to(out.resolve()) else target} does not exist")
                continue
            if parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{page.relative_to(out)}: {ref!r}: no id {parts.fragment!r} in {target.name}")
    return problems


def example_times(docs: Path = DOCS) -> list[tuple[str, float]]:
    """(example, seconds) from sphinx-gallery's execution record."""
    out = []
    for f in [docs / "sg_execution_times.rst", docs / "auto_examples" / "sg_execution_times.rst"]:
        if f.exists():
            for m in re.finditer(r":ref:`sphx_glr_auto_examples_(\w+)\.py`.*?\n\s*-\s*(\d+):(\d+(?:\.\d+)?)", f.read_text()):
                out.append((m.group(1), int(m.group(2)) * 60 + float(m.group(3))))
            if out:
                break
    return out


#: the modules the build needs (import name, the package that provides it); all in the docs extra
NEEDED = (("sphinx", "sphinx"), ("sphinx_gallery", "sphinx-gallery"), ("myst_parser", "myst-parser"))
INSTALL = 'pip install -e ".[docs]"'


def missing_packages() -> list[str]:
    """The packages of :data:`NEEDED` that are not installed (found without importing them)."""
    import importlib.util

    return [dist for mod, dist in NEEDED if importlib.util.find_spec(mod) is None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clean", action="store_true", help="remove the build and the generated sources first")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--max-example-seconds", type=float, default=0.0,
                    help="fail when a gallery example runs longer (0: report only)")
    ap.add_argument("--screenshots", action="store_true", help="also render PNG screenshots (headless Chromium)")
    args = ap.parse_args(argv)
    missing = missing_packages()
    if missing:
        print(f"build_docs: the documentation build needs {', '.join(missing)}, which "
              f"{'is' if len(missing) == 1 else 'are'} not installed; install the docs extra from the repository "
              f"root:\n  {INSTALL}\n(the pages are also readable as they are: docs/*.md)", file=sys.stderr)
        return 2
    if args.clean:
        for p in GENERATED:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", str(DOCS), str(args.out)]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        print(f"sphinx failed (exit {rc}) after {wall:.0f} s", file=sys.stderr)
        return rc
    problems = check_links(args.out)
    for p in problems:
        print("broken:", p, file=sys.stderr)
    times = example_times()
    slow = [(n, s) for n, s in times if args.max_example_seconds and s > args.max_example_seconds]
    print(f"\ngallery: {len(times)} examples, {sum(s for _, s in times):.0f} s in all")
    for n, s in sorted(times, key=lambda t: -t[1]):
        print(f"  {s:6.1f} s  {n}{'   <- over the limit' if (n, s) in slow else ''}")
    pages = len(list(args.out.rglob('*.html')))
    print(f"built {pages} pages in {wall:.0f} s; {len(problems)} broken links or images -> {args.out / 'index.html'}")
    if problems or slow:
        return 1
    if args.screenshots:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_screenshots.py"), "--html", str(args.out)],
                              cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
