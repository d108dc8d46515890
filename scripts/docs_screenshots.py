"""Screenshots of the built documentation, as a reader's browser shows it (headless Chromium).

    python scripts/build_docs.py                 # build first
    python scripts/docs_screenshots.py           # -> docs/_build/screenshots/*.png

Renders the index, the model page, the ``tp.simulate`` API page and two gallery pages with Debian's
``chromium`` (``apt-get install chromium``) in headless mode and writes one PNG per page.  A
missing page or a browser that fails is an error (exit 1); a missing browser says how to
install it (exit 2).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "docs" / "_build" / "html"
PAGES = {
    "index": "index.html",
    "model": "model.html",
    "api_simulate": "api/generated/transformer_pde.simulate.html",
    "gallery_ou_vs_oscillating": "auto_examples/plot_ou_vs_oscillating.html",
    "gallery_jko_vs_particles": "auto_examples/plot_jko_vs_particles.html",
}
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def browser() -> str | None:
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def screenshot(exe: str, page: Path, png: Path, *, width: int = 1280, height: int = 1600, timeout: float = 120) -> None:
    with tempfile.TemporaryDirectory() as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", "--virtual-time-budget=5000",
               f"--screenshot={png.resolve()}", page.resolve().as_uri()]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not png.exists() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium failed on {page} (exit {r.returncode}): {r.stderr[-1500:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", type=Path, default=HTML, help="the built site (default docs/_build/html)")
    ap.add_argument("--out", type=Path, default=None, help="where the PNGs go (default <html>/../screenshots)")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--height", type=int, default=1600)
    args = ap.parse_args(argv)
    exe = browser()
    if exe is None:
        print("no Chromium found: apt-get update && apt-get install -y chromium", file=sys.stderr)
        return 2
    out = args.out or args.html.parent / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    missing = [rel for rel in PAGES.values() if not (args.html / rel).exists()]
    if missing:
        print(f"not built: {missing} (run python scripts/build_docs.py first)", file=sys.stderr)
        return 1
    for name, rel in PAGES.items():
        png = out / f"{name}.png"
        png.unlink(missing_ok=True)
        screenshot(exe, args.html / rel, png, width=args.width, height=args.height)
        print(f"{png}  ({png.stat().st_size // 1024} KiB)  <- {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
