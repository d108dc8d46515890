"""Packaging: the wheel ships every module, the configs and py.typed; every import is declared;
the sources parse on Python 3.10–3.13; the tomli fallback; a fresh venv runs a config by name.

The wheel is built from a copy of the source tree in a temporary directory (setuptools writes
build/ and *.egg-info next to the sources; the copy keeps the checkout untouched), without
network (`--no-index --no-build-isolation`).
"""

import ast
import email.parser
import functools
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from transformer_pde.utils.resources import tomllib

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "transformer_pde"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# import name -> distribution name, where they differ or the distribution may not be installed
IMPORT_TO_DIST = {"ot": "pot", "pykeops": "pykeops", "keopscore": "pykeops", "dask": "dask", "distributed": "dask",
                  "yaml": "pyyaml", "PIL": "pillow", "imageio": "imageio", "tomli": "tomli", "sklearn": "scikit-learn"}


def _sources():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _dist_name(req: str) -> str:
    return re.split(r"[\s;<>=!~\[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared():
    proj = PYPROJECT["project"]
    deps = {_dist_name(r) for r in proj["dependencies"]}
    extras = {_dist_name(r) for reqs in proj.get("optional-dependencies", {}).values() for r in reqs}
    return deps, extras


def _third_party_imports():
    """Top-level names imported anywhere in the package (module level or inside functions)."""
    found = {}
    for path in _sources():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "transformer_pde" and top != "__future__":
                    found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_every_third_party_import_is_declared():
    from importlib.metadata import packages_distributions

    deps, extras = _declared()
    installed = None
    missing = []
    for top, files in sorted(_third_party_imports().items()):
        dists = {IMPORT_TO_DIST.get(top, top.lower().replace("_", "-"))}
        if not dists & (deps | extras):  # ask the installed metadata (slow: scans every distribution)
            installed = packages_distributions() if installed is None else installed
            dists |= {d.lower().replace("_", "-") for d in installed.get(top, [])}
        if not dists & (deps | extras):
            missing.append(f"{top} (imported in {', '.join(sorted(files))})")
    assert not missing, f"imports not declared in pyproject.toml dependencies or extras: {missing}"
    # the ones that every run needs are hard dependencies, not extras
    for dist in ("torch", "numpy", "scipy", "matplotlib", "pillow", "tqdm", "torchdiffeq", "pot", "geomloss"):
        assert dist in deps, f"{dist} must be a dependency (imported on ordinary code paths)"


def test_requires_python_and_classifiers_agree():
    proj = PYPROJECT["project"]
    assert proj["requires-python"] == ">=3.10"
    listed = {c.rsplit(" ", 1)[-1] for c in proj["classifiers"] if re.fullmatch(r".*Python :: 3\.\d+", c)}
    assert listed == {"3.10", "3.11", "3.12", "3.13"}
    assert any(r.startswith("tomli") and "python_version < '3.11'" in r for r in proj["dependencies"])


def _imported(node):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def test_tomllib_is_only_imported_with_the_tomli_fallback():
    # Python 3.10 has no tomllib: import it through `from .resources import tomllib`, or inside
    # `try: import tomllib` / `except ImportError: import tomli as tomllib`
    offenders = []
    for path in _sources():
        guarded = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Try):
                catches = {getattr(h.type, "id", None) for h in node.handlers}
                fallback = any("tomli" in _imported(n) for h in node.handlers for n in ast.walk(h))
                if catches & {"ImportError", "ModuleNotFoundError"} and fallback:
                    guarded |= {id(n) for b in node.body for n in ast.walk(b)}
        for node in ast.walk(_tree(path)):
            if "tomllib" in [n.split(".")[0] for n in _imported(node)] and id(node) not in guarded:
                offenders.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert not offenders, f"`import tomllib` without the tomli fallback (use `from .resources import tomllib`): " \
                          f"{offenders}"


def _interpreter(minor):
    """A working python3.<minor> on this machine (PATH, then pyenv's versions), or None."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [*sorted(map(str, root.glob(f"versions/3.{minor}.*/bin/python3.{minor}"))), shutil.which(f"python3.{minor}")]
    for exe in filter(None, candidates):
        try:
            r = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True,
                               timeout=60)
        except OSError:
            continue
        if r.returncode == 0 and r.stdout.strip() == f"(3, {minor})":
            return exe
    return None


@pytest.mark.parametrize("minor", [10, 11, 12, 13])
def test_sources_compile_on_supported_pythons(minor):
    """Compile every module with the real interpreter of each supported version when the
    machine has it (pyenv ships 3.10–3.13 here; nothing is written); otherwise parse with that
    grammar version (best effort)."""
    sources = [str(p) for p in _sources()]
    if sys.version_info[:2] == (3, minor):
        for f in sources:
            compile(Path(f).read_text(), f, "exec", dont_inherit=True)
        return
    exe = _interpreter(minor)
    code = ("import sys, pathlib\n"
            f"if sys.version_info[:2] != (3, {minor}): print('wrong version', sys.version); sys.exit(3)\n"
            "for f in sys.argv[1:]: compile(pathlib.Path(f).read_text(), f, 'exec', dont_inherit=True)\n")
    r = None if exe is None else subprocess.run([exe, "-c", code, *sources], capture_output=True, text=True,
                                                timeout=120)
    if r is None:
        for f in sources:
            ast.parse(Path(f).read_text(), filename=f, feature_version=(3, minor))
        return
    assert r.returncode == 0, f"Python 3.{minor} cannot compile the package:\n{r.stdout}{r.stderr[-3000:]}"


_HIDE_TOMLLIB = (
    "import sys\n"
    "import tomllib as parser\n"
    "for k in [k for k in sys.modules if k == 'tomllib' or k.startswith('tomllib.')]: del sys.modules[k]\n"
    "sys.modules['tomli'] = parser\n"
    "sys.modules['tomllib'] = None  # `import tomllib` now raises ImportError, as on Python 3.10\n"
    "try:\n"
    "    import tomllib\n"
    "    raise SystemExit('tomllib was not hidden')\n"
    "except ImportError:\n"
    "    pass\n")


def _run_python(code, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_resources_fall_back_to_tomli(tmp_path):
    """Python 3.10's path: tomllib missing, tomli present (the stdlib parser served under the
    name tomli).  resources.py is loaded on its own (no torch import) and parses every config."""
    code = _HIDE_TOMLLIB + (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('resources_alone', {str(PKG / 'utils' / 'resources.py')!r})\n"
        "R = importlib.util.module_from_spec(spec); spec.loader.exec_module(R)\n"
        "assert R.tomllib is parser\n"
        f"import pathlib; files = sorted(pathlib.Path({str(ROOT / 'experiments')!r}).glob('*.toml'))\n"
        "assert files and all(R.load_toml(f)['kind'] for f in files)\n"
        "assert R.loads_toml('a = [1, 2]') == {'a': [1, 2]}\n"
        "print(len(files))\n")
    assert int(_run_python(code, tmp_path).split()[-1]) == len(list((ROOT / "experiments").glob("*.toml")))


@pytest.mark.slow
def test_import_everything_without_tomllib(tmp_path):
    """The whole package with tomllib hidden: every module imports, every config resolves."""
    code = _HIDE_TOMLLIB + (
        "import importlib, pkgutil\n"
        "import transformer_pde, transformer_pde.utils.resources as R\n"
        "assert R.tomllib is parser\n"
        "for m in pkgutil.walk_packages(transformer_pde.__path__, 'transformer_pde.'):\n"
        "    importlib.import_module(m.name)\n"
        "from transformer_pde.application.config import load_config\n"
        "names = R.config_names()\n"
        "for n in names: load_config(R.config_path(n))\n"
        "print(len(names))\n")
    assert int(_run_python(code, tmp_path).split()[-1]) == len(list((ROOT / "experiments").glob("*.toml")))


def test_resources_find_the_checkout_configs():
    from transformer_pde.utils import resources

    shipped = sorted(p.stem for p in (ROOT / "experiments").glob("*.toml"))
    assert resources.config_names() == shipped
    for name in shipped:
        path = resources.config_path(name)
        assert path.read_bytes() == (ROOT / "experiments" / f"{name}.toml").read_bytes()
        assert resources.config_path(name + ".toml") == path
        assert resources.find_config(f"experiments/{name}.toml").read_bytes() == path.read_bytes()
        assert resources.find_config(name) == path
        assert resources.load_toml(path) == tomllib.loads(path.read_text())


@pytest.mark.parametrize("bad,err", [("no_such_config", ValueError), ("../pyproject", ValueError),
                                     ("", ValueError), (3, TypeError)])
def test_resources_refuse_bad_names(bad, err):
    from transformer_pde.utils import resources

    with pytest.raises(err, match="config"):
        resources.config_path(bad)
    if isinstance(bad, str) and bad:
        with pytest.raises(ValueError, match="ou_vs_oscillating_quick"):  # lists what exists
            resources.find_config(bad)


def test_license_and_citation():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "The transformer_pde authors" in text
    cff = (ROOT / "CITATION.cff").read_text()
    readme = (ROOT / "README.md").read_text()
    citing = readme.split("## Citing", 1)[1].split("\n## ", 1)[0]
    for arxiv in ("2605.18870", "2605.04279"):
        assert arxiv in cff and arxiv in citing and arxiv in " ".join(PYPROJECT["project"]["urls"].values())
    # the same titles in CITATION.cff and the README's BibTeX
    titles = re.findall(r'^\s*-?\s*type: article\n\s*title: "([^"]+)"', cff, flags=re.M)
    assert len(titles) == 2
    for t in titles:
        assert t in citing.replace("{", "").replace("}", "")
    try:
        import yaml
    except ImportError:
        return
    meta = yaml.safe_load(cff)
    assert meta["cff-version"] == "1.2.0" and meta["license"] == "MIT"
    assert meta["version"] == PYPROJECT["project"]["version"]


# ------------------------------------------------------------------------------------- the wheel

def _build_wheel(dest: Path) -> Path:
    src = dest / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE", "CITATION.cff", "_transformer_pde_cli.py"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(PKG, src / "transformer_pde", ignore=ignore)
    shutil.copytree(ROOT / "experiments", src / "experiments", ignore=ignore)
    out = dest / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "--no-cache-dir", "-q", "-w", str(out), str(src)], capture_output=True, text=True,
                       timeout=600, cwd=dest)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    (wheel,) = out.glob("transformer_pde-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_ships_modules_configs_and_py_typed(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in _sources():  # every module, i.e. every subpackage is listed in pyproject.toml
        rel = path.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} is missing from the wheel: add its package to [tool.setuptools] packages"
    for cfg in (ROOT / "experiments").glob("*.toml"):
        assert f"transformer_pde/configs/{cfg.name}" in names
    assert "transformer_pde/py.typed" in names
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert f"{dist_info}/licenses/LICENSE" in names
    assert not any(n.startswith(("experiments/", "tests/", "scripts/")) for n in names)
    with zipfile.ZipFile(wheel) as z:
        meta = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    assert meta["Requires-Python"] == ">=3.10"
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("scipy") for r in requires)
    assert any(r.startswith("tomli") and 'python_version < "3.11"' in r for r in requires)
    assert meta.get("License-Expression") == "MIT"
    assert "transformer-pde = _transformer_pde_cli:main" in entry_points
    assert "_transformer_pde_cli.py" in names  # the command's launcher


@pytest.mark.slow
def test_wheel_in_fresh_venv_runs_a_config_by_name(wheel, tmp_path):
    """pip install the wheel (no deps: torch etc. come from this machine through
    --system-site-packages) into a new venv and run `transformer-pde run ou_vs_oscillating_quick`
    by name, made tiny by overrides, from a directory that has no experiments/ folder."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args, timeout=600):
        r = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=work, env=env,
                           timeout=timeout)
        assert r.returncode == 0, f"{args}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    # the system pip (visible through --system-site-packages) installs into the venv's prefix;
    # --ignore-installed: the checkout's editable install must not count as "already satisfied"
    run(py, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel)
    where = run(py, "-c", "import transformer_pde as t, transformer_pde.utils.resources as r; "
                          "print(t.__file__); print(r.config_dir())").split()
    site = run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    assert Path(where[0]).resolve().is_relative_to(Path(site).resolve()), where  # not the editable checkout
    assert Path(where[1]).resolve() == (Path(site) / "transformer_pde" / "configs").resolve()

    cli = venv / "bin" / "transformer-pde"
    listing = run(cli, "list")
    assert "ou_vs_oscillating_quick" in listing
    out = run(cli, "run", "ou_vs_oscillating_quick", "-o", "heads=[1,2]", "-o", "n=6", "-o", "t1=0.2",
              "-o", "dt=0.05", "-o", "paths=2", "-o", "record_every=1", "-o", "t_avg=0.1", "-o", "bootstrap=0",
              "-o", "figures=false", "--out", work / "runs", "--threads", "1")
    run_dir = work / "runs" / "ou_vs_oscillating_quick"
    assert str(run_dir) in out
    import json

    cfg = json.loads((run_dir / "config.json").read_text())
    shipped = tomllib.loads((ROOT / "experiments" / "ou_vs_oscillating_quick.toml").read_text())
    assert cfg["kind"] == shipped["kind"] and cfg["params"]["heads"] == [1, 2]
    assert cfg["params"]["seed"] == shipped["params"]["seed"]  # the rest comes from the shipped file
    assert json.loads((run_dir / "status.json").read_text())["state"] == "complete"
    assert {"b_ou", "b_oscillating"} <= set(json.loads((run_dir / "metrics.json").read_text()))


def test_public_functions_stay_functions_whatever_is_imported():
    """``tp.energy``, ``tp.mobility``, ``tp.velocity`` are functions, and importing every module of the
    package (their own modules included) leaves them so: a module must never shadow a public name of
    the facade.  A finder that mapped old dotted paths (``transformer_pde.energy``) onto the moved
    modules made the import system bind ``tp.energy`` to the module; this test fails on that."""
    code = (
        "import importlib, pkgutil\n"
        "import transformer_pde as tp\n"
        "names = [n for n in tp.__all__ if callable(getattr(tp, n)) and not isinstance(getattr(tp, n), type)]\n"
        "before = {n: getattr(tp, n) for n in names}\n"
        "for m in pkgutil.walk_packages(tp.__path__, 'transformer_pde.'):\n"
        "    if m.name.endswith('__main__'):\n"
        "        continue\n"
        "    importlib.import_module(m.name)\n"
        "for old in ('energy', 'mobility', 'field', 'heads'):\n"
        "    try:\n"
        "        importlib.import_module('transformer_pde.' + old)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('the old path transformer_pde.' + old + ' still imports')\n"
        "changed = [n for n in names if getattr(tp, n) is not before[n]]\n"
        "assert not changed, changed\n"
        "assert callable(tp.energy) and not isinstance(tp.energy, type(tp))\n"
        "print('ok')\n")
    assert _run_python(code, ROOT).split()[-1] == "ok"  # the checkout's package
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "transformer_pde.application.cli", "list"], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0 and "experiment kinds" in r.stdout, r.stderr[-2000:]
