"""The package's import graph: layers import only downwards, and no private name crosses modules.

Parses every module of transformer_pde with ``ast`` (module-level and function-level imports
alike, so a "lazy" import inside a function counts) and checks

* the layer order of ARCHITECTURE.md: a module imports only modules of strictly lower layers;
* no module imports another module's ``_private`` name (what modules share is a named internal
  API: public names, listed in the module's ``__internal__`` when they are not in ``__all__``);
* every module of the package has a layer (a new module must be placed).
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "transformer_pde"

# lowest first; a module may import only from layers before its own
LAYERS = [
    {"transformer_pde.normalization"},  # the attention normalisations (strategy objects; no imports)
    {"transformer_pde._validation", "transformer_pde.threads", "transformer_pde.resources"},
    {"transformer_pde.sphere"},
    {"transformer_pde.heads"},
    {"transformer_pde.attention", "transformer_pde.transport"},  # kernels; optimal transport
    {"transformer_pde.field"},
    {"transformer_pde.energy"},
    {"transformer_pde.mobility"},
    {"transformer_pde.processes"},  # weight processes and the Θ_t grid driver
    {"transformer_pde.nn"},
    # the layer-normalisation schemes (the step's geometry); Butcher tableaux; Trajectory and the errors
    {"transformer_pde.solvers.layernorm", "transformer_pde.solvers.tableaux", "transformer_pde.solvers.trajectory"},
    {"transformer_pde.solvers.lbfgs"},  # Riemannian L-BFGS on a product of spheres (the JKO's inner solver)
    {"transformer_pde.solvers", "transformer_pde.solvers.parts", "transformer_pde.solvers.noise",
     "transformer_pde.solvers.options"},
    {"transformer_pde.solvers.model"},  # Model: Θ_t, normalisation, geometry, token noise
    {"transformer_pde.solvers.methods"},  # the solver objects
    {"transformer_pde.solvers.evaluator"},  # the field evaluation and common scale of a particle solve
    {"transformer_pde.solvers.fixed_step", "transformer_pde.solvers.adaptive"},  # the particle solves
    {"transformer_pde.solvers.particle"},  # tp.simulate (keyword front end) and the argument checks
    {"transformer_pde.solvers.sharded"},  # the sharded (multi-device) projected Euler
    {"transformer_pde.solvers.jko_lagrangian", "transformer_pde.solvers.jko_eulerian"},  # the two JKO schemes
    {"transformer_pde.solvers.jko", "transformer_pde.distributed"},
    {"transformer_pde.solvers.solve"},  # tp.solve
    # Lipschitz and Grönwall constants, fast-weights coefficients; linear stability of the uniform measure
    {"transformer_pde.theory.stability", "transformer_pde.theory.noise"},
    {"transformer_pde.clustering", "transformer_pde.ensembles", "transformer_pde.theory"},  # generic; closed forms
    {"transformer_pde.theory.particles"},  # the particle diagnostics of the theory
    {"transformer_pde.diagnostics"},  # tp.diagnostics = theory.particles
    {"transformer_pde"},  # the public facade (import transformer_pde as tp)
    {"transformer_pde.plotting"},
    {"transformer_pde.animation"},
    {"transformer_pde.studies"},
    {"transformer_pde.studies.demo", "transformer_pde.studies.paper", "transformer_pde.studies.theory",
     "transformer_pde.studies.jko", "transformer_pde.studies.clustering", "transformer_pde.studies.causal",
     "transformer_pde.studies.layernorm", "transformer_pde.studies.noisy"},
    {"transformer_pde.studies.theorems"},  # composes studies.jko (the uniqueness panel)
    {"transformer_pde.runs"},
    {"transformer_pde.sweep"},
    {"transformer_pde.cli"},
]
RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def import_edges():
    """(importer, imported module, imported name or None, line) for every import inside the package."""
    mods = _modules()
    edges = []
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges += [(name, a.name, None, node.lineno) for a in node.names if a.name.startswith("transformer_pde")]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("transformer_pde"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:  # from . import threads: the submodule itself
                        edges.append((name, sub, None, node.lineno))
                    else:
                        edges.append((name, target, a.name, node.lineno))
    return edges


def test_every_module_has_a_layer():
    missing = sorted(set(_modules()) - set(RANK))
    assert not missing, f"place these modules in LAYERS (and ARCHITECTURE.md): {missing}"


def test_imports_flow_downwards_only():
    bad = [f"{src}:{line} imports {dst} (layer {RANK[dst]} >= {RANK[src]})"
           for src, dst, _, line in import_edges() if src in RANK and dst in RANK and RANK[dst] >= RANK[src]
           and src != dst]
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_modules():
    bad = [f"{src}:{line} imports {name} from {dst}" for src, dst, name, line in import_edges()
           if name and name.startswith("_") and not name.startswith("__") and src != dst]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["field", "transport", "heads", "solvers.particle", "solvers.parts",
                                    "solvers.layernorm"])
def test_internal_api_is_named_and_exists(module):
    import importlib

    mod = importlib.import_module(f"transformer_pde.{module}")
    internal = getattr(mod, "__internal__")
    assert internal and all(hasattr(mod, n) and not n.startswith("_") for n in internal)


def test_checker_sees_a_cycle_and_a_private_import(tmp_path, monkeypatch):
    """The checks can fail: a fake heads module that imports the solver and a private name is caught."""
    fake = tmp_path / "transformer_pde"
    (fake / "solvers").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "solvers" / "__init__.py").write_text("")
    (fake / "solvers" / "particle.py").write_text("from ..heads import Heads\n")
    (fake / "heads.py").write_text("def f():\n    from .solvers.particle import _WeightDriver\n")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    edges = import_edges()
    assert ("transformer_pde.heads", "transformer_pde.solvers.particle", "_WeightDriver", 2) in edges
    with pytest.raises(AssertionError, match="heads:2 imports transformer_pde.solvers.particle"):
        test_imports_flow_downwards_only()
    with pytest.raises(AssertionError, match="imports _WeightDriver"):
        test_no_private_name_crosses_modules()
