"""The ``transformer-pde`` command: run experiment configs, list them, run a demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def _configs_dir() -> Path:
    # the shipped configs live in <repo>/experiments; fall back to the working directory
    here = Path(__file__).resolve().parent.parent / "experiments"
    return here if here.is_dir() else Path("experiments")


def _cmd_run(args) -> int:
    from .runs import execute

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    try:
        path = execute(args.config, overrides=args.override, out_dir=args.out, name=args.name, resume=args.resume,
                       progress=not args.no_progress, overwrite=args.overwrite)
    except KeyboardInterrupt:
        again = " ".join(["transformer-pde run", args.config, *[f"-o '{o}'" for o in args.override],
                          *(["--out", args.out] if args.out != "runs" else []),
                          *(["--name", args.name] if args.name else []),
                          *(["--threads", str(args.threads)] if args.threads else []), "--resume"])
        print(f"\ntransformer-pde: interrupted; continue with:\n  {again}", file=sys.stderr)
        return 130
    metrics = json.loads((path / "metrics.json").read_text())
    print(f"run directory: {path}")
    for line in metrics.get("summary", []):
        print(f"  {line}")
    for k, v in metrics.items():
        if isinstance(v, (int, float, str)) and not isinstance(v, bool):
            print(f"  {k} = {v}")
    return 0


def _cmd_list(args) -> int:
    from .studies import available

    print("experiment kinds:")
    for kind, st in available().items():
        print(f"  {kind:28s} {st.description}")
    cdir = _configs_dir()
    if cdir.is_dir():
        print(f"configs in {cdir}:")
        for p in sorted(cdir.glob("*.toml")):
            print(f"  {p}")
    if args.kind:
        from .studies import get_study

        st = get_study(args.kind)
        print(f"\nparameters of {args.kind}:")
        for key, opt in st.options.items():
            ch = f" choices={list(opt.choices)}" if opt.choices else ""
            print(f"  {key:20s} default={opt.default!r}{ch}  {opt.help}")
    return 0


def _cmd_demo(args) -> int:
    from .runs import execute

    path = execute({"kind": "demo", "name": args.name, "params": {}}, out_dir=args.out, resume=False,
                   name=args.name, progress=not args.no_progress) if not (Path(args.out) / args.name).exists() else None
    if path is None:
        import shutil

        shutil.rmtree(Path(args.out) / args.name)
        path = execute({"kind": "demo", "name": args.name, "params": {}}, out_dir=args.out, progress=not args.no_progress)
    print(f"demo written to {path}")
    print(json.dumps(json.loads((path / "metrics.json").read_text()), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="transformer-pde", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run an experiment config (TOML)")
    r.add_argument("config", help="path to a TOML config, e.g. experiments/ou_vs_oscillating_quick.toml")
    r.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="override a parameter (TOML value), repeatable: -o n=100 -o 'heads=[1,10]'")
    r.add_argument("--out", default="runs", help="parent folder of the run directory (default: runs)")
    r.add_argument("--name", default=None, help="run directory name (default: the config's name)")
    r.add_argument("--resume", action="store_true",
                   help="continue an interrupted run (same config and overrides): finished parts are kept, a partial "
                        "one continues from its checkpoint")
    r.add_argument("--overwrite", action="store_true", help="delete an existing run directory of that name first")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")
    r.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's choice; 1 is often faster on a busy or 2-core machine)")
    r.set_defaults(fn=_cmd_run)
    ls = sub.add_parser("list", help="list experiment kinds and shipped configs")
    ls.add_argument("kind", nargs="?", help="show the parameters of one kind")
    ls.set_defaults(fn=_cmd_list)
    d = sub.add_parser("demo", help="a small run (seconds) that writes runs/demo")
    d.add_argument("--out", default="runs")
    d.add_argument("--name", default="demo")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(fn=_cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError) as e:
        print(f"transformer-pde: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # NonFiniteError: the run blew up (time, step and quantity in the message)
        print(f"transformer-pde: the run produced NaN/inf: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
