"""The ``transformer-pde`` command: run experiment configs, list them, run a demo.

Results (run directories, metrics, listings) go to stdout; progress bars, per-segment lines,
warnings and errors go to stderr.  Exit codes (:data:`EXIT_CODES`, docs/reliability.md): 0 done,
2 refused before anything ran (bad input, nothing written), 1 failed during a run (3 when it
failed by producing NaN/inf), 130 interrupted by Ctrl-C, 143 by SIGTERM (both leave the run
resumable with ``--resume``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import List, Optional

__all__ = ["main", "build_parser", "EXIT_CODES", "max_threads", "headline"]

EXIT_CODES = {0: "done", 1: "failed during a run (the run directory says why; --resume continues it)",
              2: "refused before anything ran (bad config, option, name, folder or resource estimate; nothing "
                 "was written)",
              3: "failed during a run because it produced NaN/inf (time, step and quantity in the message)",
              130: "interrupted (Ctrl-C); --resume continues it",
              143: "terminated by SIGTERM (128 + 15); --resume continues it"}

_EPILOG = "exit codes:\n" + "\n".join(f"  {k:<4} {v}" for k, v in EXIT_CODES.items()) + (
    "\n\nrun directories, locks, resume, atomic writes and resource limits: docs/reliability.md")

_DESCRIPTION = """\
Run the experiments of transformer_pde: token flows on the sphere driven by random attention weights.

  transformer-pde run ou_vs_oscillating_quick          a shipped config by name (or a path to a TOML file)
  transformer-pde run A.toml B.toml -o paths=2         several configs, one run directory each
  transformer-pde run CONFIG --resume                  continue after Ctrl-C, SIGTERM or a kill
  transformer-pde list [KIND]                          experiment kinds, shipped configs, parameters
  transformer-pde demo                                 a run of a few seconds into runs/demo

Results go to stdout, progress and messages to stderr.  `transformer-pde COMMAND --help` shows
the options of a command."""

_LOG = "transformer_pde"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (tests swap it); while progress bars are
    drawn, through ``tqdm.write``, which clears the bars, writes the line on a line of its own and draws them again
    (a plain write would land inside a bar's line)."""

    def emit(self, record):
        self.stream = sys.stderr
        bars = sys.modules.get("tqdm")
        if bars is None or not any(not getattr(b, "disable", True) for b in list(getattr(bars.tqdm, "_instances", ()))):
            super().emit(record)
            return
        try:
            bars.tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # pragma: no cover - logging never raises
            self.handleError(record)


def max_threads() -> int:
    """The largest --threads accepted: 4 × the CPU cores of this machine (more only oversubscribes; a huge count
    crashes the OpenMP runtime)."""
    return 4 * (os.cpu_count() or 1)


def _threads_arg(text: str):
    t = text.strip().lower()
    if t == "auto":
        return "auto"
    if t.isdigit() and int(t) >= 1:
        if int(t) > max_threads():
            raise argparse.ArgumentTypeError(f"{t} threads is more than this machine can use: give at most "
                                             f"{max_threads()} (4 × its {os.cpu_count()} CPU cores) or 'auto'")
        return int(t)
    raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {text!r}")


def _size_arg(text: str) -> int:
    from .config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count_arg(text: str) -> int:
    t = text.strip().replace("_", "")
    try:
        v = int(float(t)) if "e" in t.lower() else int(t)
    except (ValueError, OverflowError):
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (e.g. 1e9), got {text!r}")
    return v


def _setup(args):
    """Logging handler, level and thread policy for one command; returns a function that undoes them."""
    from ..utils import threads

    lg = logging.getLogger(_LOG)
    old_level, old_prop = lg.level, lg.propagate
    h = _StderrHandler()
    h.setFormatter(logging.Formatter("%(message)s"))
    verbosity = getattr(args, "verbose", 0) - getattr(args, "quiet", 0)
    lg.setLevel(logging.DEBUG if verbosity > 0 else logging.INFO if verbosity == 0 else
                logging.WARNING if verbosity == -1 else logging.ERROR)
    lg.addHandler(h)
    mode = getattr(args, "threads", "auto")
    import torch

    old_threads = torch.get_num_threads()  # before the policy: "auto" sets the process's count
    old_policy = threads.policy(mode)
    if isinstance(mode, int):
        torch.set_num_threads(mode)

    def undo():
        lg.removeHandler(h)
        lg.setLevel(old_level)
        lg.propagate = old_prop
        threads.policy(old_policy)
        if torch.get_num_threads() != old_threads:
            torch.set_num_threads(old_threads)

    return undo


def _resume_command(args, config: str, name: Optional[str]) -> str:
    parts = ["transformer-pde", "run", config] + [a for o in args.override for a in ("-o", o)]
    if args.out != "runs":
        parts += ["--out", args.out]
    if name is not None:
        parts += ["--name", name]
    if args.threads != "auto":
        parts += ["--threads", str(args.threads)]
    parts.append("--resume")
    return " ".join(shlex.quote(p) for p in parts)


def _fmt(v) -> str:
    """A metric for the terminal: floats to 4 significant digits (metrics.json keeps every digit)."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _mean_sem(v) -> bool:
    return isinstance(v, dict) and isinstance(v.get("mean"), (int, float)) and not isinstance(v.get("mean"), bool) \
        and "sem" in v


def headline(metrics: dict) -> List[str]:
    """The lines a finished run prints under its run directory: the study's ``summary`` lines when it writes
    some; else its claims (value ± error, reference, verdict), its tables of mean ± standard error (one line per
    table: ``test_accuracy: flow 0.854 ± 0.013, transformer 0.875 ± 0.003``) and its top-level numbers."""
    summary = metrics.get("summary") or []
    if summary:
        return [str(line) for line in summary]
    lines = []
    for c in metrics.get("claims") or []:
        if not isinstance(c, dict) or "name" not in c:
            continue
        err = c.get("error")
        ref = c.get("reference")
        verdict = {True: "holds", False: "DOES NOT HOLD", None: "no verdict"}.get(c.get("holds"), "no verdict")
        lines.append(f"{c['name']}: {_fmt(c.get('value')) if c.get('value') is not None else 'undefined'}"
                     + (f" ± {_fmt(err)}" if isinstance(err, (int, float)) else "")
                     + (f" (reference {_fmt(ref)}; {verdict})" if ref is not None else f" ({verdict})"))
    for k, v in metrics.items():
        if isinstance(v, dict) and v and all(_mean_sem(x) for x in v.values()):
            lines.append(f"{k}: " + ", ".join(
                f"{name} {_fmt(x['mean'])}" + (f" ± {_fmt(x['sem'])}" if isinstance(x["sem"], (int, float)) else "")
                for name, x in v.items()) + " (mean ± standard error)")
    for k, v in metrics.items():
        if isinstance(v, (int, float, str)) and not isinstance(v, bool) and k != "wall_time_s":
            lines.append(f"{k} = {_fmt(v)}")
    return lines


def _print_metrics(path: Path, header: Optional[str] = None) -> None:
    """The results of a run on stdout, the same for `run` and `demo`: its headline numbers (:func:`headline`), the
    wall time, and where every number is."""
    from .rundir import loads_json

    metrics = loads_json((path / "metrics.json").read_text(), str(path / "metrics.json"))
    print(header or f"run directory: {path}")
    for line in headline(metrics):
        print(f"  {line}")
    wall = metrics.get("wall_time_s")
    if isinstance(wall, (int, float)):
        print(f"  wall time {wall:.1f} s")
    figures = path / "figures"
    drawn = figures.is_dir() and any(figures.iterdir())
    print(f"  every number: {path / 'metrics.json'}" + (f"; figures: {figures}" if drawn else ""))


def _config_source(text: str, find_config) -> Path:
    """A CONFIG argument: an existing file, else a shipped config name (also when a folder of that name
    exists, e.g. a run directory made with --out .); other existing paths go to load_config for its error."""
    p = Path(text)
    try:
        p.is_file()
        p.exists()
    except OSError as e:  # e.g. ENAMETOOLONG
        raise ValueError(f"config {text[:60]!r}... cannot be looked up ({e.strerror or e}); give a shorter path or a "
                         f"shipped config name (`transformer-pde list`)") from None
    if p.is_file():
        return p
    try:
        return find_config(text)
    except ValueError:
        if p.exists():
            return p  # a directory or special file: load_config says what is wrong with it
        raise


def _cmd_run(args) -> int:
    from ..utils.resources import find_config
    from .locks import Terminated
    from .runs import execute, plan

    if args.name is not None and len(args.config) > 1:
        raise ValueError(f"--name names one run directory but {len(args.config)} configs were given; "
                         f"drop --name (each config uses its own name) or run the configs one at a time")
    # every config, override and run directory is checked before anything runs or is written
    errors: List[str] = []
    jobs = []
    seen = {}
    limits = {"max_memory": args.max_memory, "max_steps": args.max_steps}
    for text in args.config:
        try:
            path = _config_source(text, find_config)
            cfg, run_path = plan(path, overrides=args.override, out_dir=args.out, name=args.name,
                                 resume=args.resume, overwrite=args.overwrite, **limits)
        except (ValueError, TypeError) as e:
            errors.append(f"{text}: {e}" if len(args.config) > 1 else str(e))
            continue
        key = str(run_path.resolve()) if run_path.parent.exists() else str(run_path)
        if key in seen:
            errors.append(f"{text}: writes the same run directory {run_path} as {seen[key]}; give the configs "
                          f"different names")
            continue
        seen[key] = text
        jobs.append((text, path))
    if errors:
        raise ValueError(errors[0] if len(args.config) == 1 else
                         "{} of {} configs refused, nothing was run:\n  {}".format(len(errors), len(args.config),
                                                                                "\n  ".join(errors)))
    failed = 0
    for i, (text, path) in enumerate(jobs):
        try:
            run_path = execute(path, overrides=args.override, out_dir=args.out, name=args.name, resume=args.resume,
                               progress=not args.no_progress, overwrite=args.overwrite, **limits)
        except KeyboardInterrupt as e:
            how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
            msg = f"\ntransformer-pde: {how}; continue with:\n  {_resume_command(args, text, args.name)}"
            rest = [t for t, _ in jobs[i + 1:]]
            if rest:
                msg += f"\nnot started: {' '.join(rest)}"
            print(msg, file=sys.stderr)
            return 128 + e.signum if isinstance(e, Terminated) else 130
        except (ValueError, TypeError, FloatingPointError) as e:
            if len(jobs) == 1:
                raise
            kind = "produced NaN/inf" if isinstance(e, FloatingPointError) else "error"
            print(f"transformer-pde: {text}: {kind}: {e}", file=sys.stderr)
            failed += 1
            continue
        _print_metrics(run_path)
    if failed:
        print(f"transformer-pde: {failed} of {len(jobs)} runs failed (see above)", file=sys.stderr)
        return 1
    return 0


def _shipped_configs():
    """[(name, path, kind, description)] of the shipped configs ([] when none are found)."""
    from ..utils.resources import config_dir, config_names, load_toml

    try:
        cdir = config_dir()
        names = config_names()
    except FileNotFoundError as e:
        logging.getLogger(_LOG).warning("%s", e)
        return []
    out = []
    for n in names:
        path = cdir / f"{n}.toml"
        try:
            raw = load_toml(path)
            kind, desc = raw.get("kind", "?"), str(raw.get("description", ""))
        except Exception:  # a broken shipped file is listed, not fatal for `list`
            kind, desc = "?", "(unreadable)"
        out.append((n, path, kind, desc))
    return out


def _last_run(run_path: Path) -> str:
    """"last run 26 s" when ``run_path`` holds a finished run (its status.json), else ""."""
    try:
        from .rundir import loads_json

        status = loads_json((run_path / "status.json").read_text(encoding="utf-8"))
        wall = float(status["wall_time_s"]) if status.get("state") == "complete" else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        wall = None
    if wall is None:
        return ""
    return f"last run {wall:.0f} s" if wall < 120 else f"last run {wall / 60:.1f} min"


def _cmd_list(args) -> int:
    from .studies import available, get_study

    st_one = get_study(args.kind) if args.kind else None  # refuse an unknown kind before printing anything
    configs = _shipped_configs()
    if st_one is not None:
        print(f"parameters of {args.kind} ({st_one.description}):")
        w = max(len(k) for k in st_one.options) + 2
        for key, opt in st_one.options.items():
            ch = f" choices={list(opt.choices)}" if opt.choices else ""
            print(f"  {key:{w}s} default={opt.default!r}{ch}  {opt.help}")
        configs = [c for c in configs if c[2] == args.kind]
    else:
        print("experiment kinds:")
        kinds = available()
        w = max(map(len, kinds)) + 2
        for kind, st in kinds.items():
            print(f"  {kind:{w}s} {st.description}")
    configs = [(n, p, d) for n, p, _, d in configs]
    if configs:
        last = {n: _last_run(Path(args.out) / n) for n, _, _ in configs}
        print(f"shipped configs{f' of kind {args.kind}' if st_one else ''} (transformer-pde run NAME), in "
              f"{configs[0][1].parent}/" + (f"; last run: the wall time of the finished run in {args.out}/"
                                            if any(last.values()) else ""))
        w = max(len(n) for n, _, _ in configs) + 2
        wl = max(map(len, last.values())) + 2 if any(last.values()) else 0
        for n, _, desc in configs:
            print(f"  {n:{w}s} {last[n]:{wl}s}{desc}".rstrip())
    if st_one is None:
        print("`transformer-pde list KIND` shows the parameters of a kind.")
    return 0


def _cmd_demo(args) -> int:
    from .locks import Terminated
    from .runs import execute

    try:
        path = execute({"kind": "demo", "name": args.name, "params": {}}, overrides=args.override, out_dir=args.out,
                       name=args.name, progress=not args.no_progress, replace_kind="demo",
                       max_memory=args.max_memory, max_steps=args.max_steps)
    except KeyboardInterrupt as e:
        print("\ntransformer-pde: demo interrupted; run `transformer-pde demo` again", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else 130
    _print_metrics(path, header=f"demo written to {path}")
    return 0


def _common_options() -> argparse.ArgumentParser:
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--threads", type=_threads_arg, default="auto", metavar="N|auto",
                   help="torch CPU threads: 'auto' (default) picks 1 for small problems and the free cores for "
                        "large ones (capped by OMP_NUM_THREADS); N uses exactly N")
    c.add_argument("-v", "--verbose", action="count", default=0, help="more messages on stderr (-v: debug)")
    c.add_argument("-q", "--quiet", action="count", default=0,
                   help="fewer messages on stderr (-q: warnings only, -qq: errors only)")
    return c


def _run_options(p: argparse.ArgumentParser, *, default_name: str) -> None:
    p.add_argument("--override", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="override a parameter (TOML value), repeatable: -o n=100 -o 'heads=[1,10]'")
    p.add_argument("--out", default="runs", metavar="DIR", help="parent folder of the run directories (default: runs)")
    p.add_argument("--name", default=None, metavar="NAME",
                   help=f"run directory name, one plain folder name under --out (default: {default_name})")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (they are shown only on a terminal anyway); messages still go to stderr")
    limit_options(p)


def limit_options(p: argparse.ArgumentParser) -> None:
    """--max-memory and --max-steps (the resource estimate's limits; `run`, `demo` and `sweep`)."""
    p.add_argument("--max-memory", type=_size_arg, default=None, metavar="SIZE",
                   help="refuse a run whose estimated memory is above SIZE (bytes, or with K/M/G/T: 16G); default: "
                        "the physical memory of this machine")
    p.add_argument("--max-steps", type=_count_arg, default=None, metavar="N",
                   help="refuse a run of more than N solver steps (all its pieces; e.g. 1e9); default 1e8")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = argparse.ArgumentParser(prog="transformer-pde", description=_DESCRIPTION, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_options()

    r = sub.add_parser("run", parents=[common], help="run experiment configs (TOML files or shipped config names)",
                       description="Run one or more experiment configs; each writes its own run directory "
                                   "OUT/NAME with the config, versions, metrics, series, data and figures.")
    r.add_argument("config", nargs="+", metavar="CONFIG",
                   help="a TOML file (e.g. experiments/ou_vs_oscillating_quick.toml) or a shipped config name "
                        "(e.g. ou_vs_oscillating_quick; `transformer-pde list` shows them); several run one after "
                        "the other")
    _run_options(r, default_name="the config's name")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true",
                   help="continue an interrupted run (same config and overrides): finished parts are kept, a partial "
                        "one continues from its checkpoint")
    g.add_argument("--overwrite", action="store_true",
                   help="empty an existing run directory of that name and start afresh (only a directory made by "
                        "transformer-pde, never another folder, never a run that is still going)")
    r.set_defaults(fn=_cmd_run)

    ls = sub.add_parser("list", parents=[common], help="list experiment kinds and shipped configs",
                        description="List the experiment kinds and the shipped configs, or the parameters of a kind.")
    ls.add_argument("kind", nargs="?", metavar="KIND", help="show the parameters of this kind (default, choices, help)")
    ls.add_argument("--out", default="runs", metavar="DIR",
                    help="where to look for finished runs of the shipped configs (their wall time; default: runs)")
    ls.set_defaults(fn=_cmd_list)

    d = sub.add_parser("demo", parents=[common], help="a small run (seconds) that writes runs/demo",
                       description="A run of a few seconds: tokens on S² under OU heads, the energy ledger. "
                                   "Running it again replaces an earlier demo run directory; any other folder of "
                                   "that name is refused and left untouched.")
    _run_options(d, default_name="demo")
    d.set_defaults(fn=_cmd_demo, name="demo")
    from .sweep import add_parser as _add_sweep

    limits = argparse.ArgumentParser(add_help=False)
    limit_options(limits)
    _add_sweep(sub, parents=[common, limits])
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors (exit code 2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:  # Ctrl-C while the command starts (its modules are being imported)
        print("\ntransformer-pde: interrupted before any run started; nothing to resume", file=sys.stderr)
        return 130
    undo = _setup(args)
    from .runs import failed_run_dir

    try:
        return args.fn(args)
    except FloatingPointError as e:  # NonFiniteError: the run blew up (time, step and quantity in the message)
        print(f"transformer-pde: the run produced NaN/inf: {e}", file=sys.stderr)
        return 3
    except BrokenPipeError:  # stdout closed early (`transformer-pde list | head`): not an error of the command
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ImportError as e:  # an optional dependency a command needs (e.g. dask for sweep --scheduler)
        print(f"transformer-pde: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as e:  # refused before anything ran: 2; failed during a run: 1
        run_dir = failed_run_dir(e)
        if run_dir is not None or isinstance(e, OSError):
            where = f" (run directory {run_dir}; --resume continues it)" if run_dir is not None else ""
            print(f"transformer-pde: error during the run{where}: {e}", file=sys.stderr)
            return 1
        print(f"transformer-pde: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before any run started (a run's own interruption is handled by its command)
        print("\ntransformer-pde: interrupted before any run started; nothing to resume", file=sys.stderr)
        return 130
    finally:
        undo()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
