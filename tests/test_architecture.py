"""The package's import graph: layers import only downwards, and nothing private crosses modules.

Parses every module of transformer_pde with ``ast`` (module-level and function-level imports
alike, so a "lazy" import inside a function counts) and checks

* the sub-package order of ARCHITECTURE.md: utils < model < processes < dynamics < solvers < nn < analysis <
  the facade (``transformer_pde/__init__.py``) < application; a module imports only from its own
  sub-package or lower ones;
* the finer layer order inside them (``LAYERS``): a module imports only modules of strictly
  lower layers;
* no module imports another module's ``_private`` name (what modules share is a named internal
  API: public names, listed in the module's ``__internal__`` when they are not in ``__all__``);
* no module reads or writes a ``_private`` attribute that another module of the package defines
  (``heads._symmetric`` from a solver, say): classes expose what others need as public
  properties or methods;
* every module of the package has a layer (a new module must be placed).
"""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "transformer_pde"

# lowest first; a module may import only from layers before its own
LAYERS = [
    {"transformer_pde.model.normalization"},  # the attention normalisations (strategy objects; no imports)
    {"transformer_pde.utils.validation", "transformer_pde.utils.threads", "transformer_pde.utils.resources",
     "transformer_pde.utils.hardware", "transformer_pde.utils.recycle",
     "transformer_pde.utils", "transformer_pde.model", "transformer_pde.analysis", "transformer_pde.application"},
    {"transformer_pde.model.sphere"},
    {"transformer_pde.model.scaling"},  # β as a rule of the context length n
    {"transformer_pde.model.factors"},  # checks of factored heads (shapes, dense memory)
    {"transformer_pde.model.heads"},
    {"transformer_pde.model.positional"},  # the positional biases of causal attention (ALiBi, kinetic decay, kernels)
    {"transformer_pde.model.backends"},  # the kernel backends (policy, availability) and the block plumbing
    {"transformer_pde.model.moments"},  # HeadStats and the moment algebra of the kernel statistics
    {"transformer_pde.model.softmax", "transformer_pde.model.transport"},  # softmax kernels; optimal transport
    {"transformer_pde.model.plans", "transformer_pde.model.values",
     "transformer_pde.model.pair_block"},  # ReLU/Sinkhorn/hardmax plans; the values-first kernel; one-block kernel
    {"transformer_pde.model.positional_kernel"},
    {"transformer_pde.model.finite_part"},  # the energy's 1/(2β) and its finite part at β = 0  # positional attention's block kernel
    {"transformer_pde.model.field"},
    {"transformer_pde.model.energy"},
    {"transformer_pde.model.mobility"},
    {"transformer_pde.processes.weights"},  # the weight processes
    {"transformer_pde.processes.paths",  # a stored weight path (replay)
     "transformer_pde.processes.homogenized"},  # random layers: values drawn afresh per layer and head
    {"transformer_pde.processes.driver"},  # the Θ_t grid driver of every solver; sample_path
    {"transformer_pde.processes.model_files"},  # a pretrained network's files: the shared cache, the reading checks
    {"transformer_pde.processes.nn", "transformer_pde.processes.pretrained"},
    {"transformer_pde.processes"},  # the package re-exports the weight processes
    # what a solve integrates: the layer-normalisation schemes (the step's geometry); the token noise
    {"transformer_pde.dynamics", "transformer_pde.dynamics.layernorm", "transformer_pde.dynamics.noise"},
    {"transformer_pde.dynamics.model"},  # Model: Θ_t, normalisation, geometry, token noise
    # Butcher tableaux; Trajectory and the errors
    {"transformer_pde.solvers.tableaux", "transformer_pde.solvers.trajectory"},
    {"transformer_pde.solvers.jko.lbfgs"},  # Riemannian L-BFGS on a product of spheres (the JKO's inner solver)
    # the packages (docstrings only); the solver parts, the options objects, the recorded diagnostics
    {"transformer_pde.solvers", "transformer_pde.solvers.jko", "transformer_pde.solvers.particle",
     "transformer_pde.solvers.parts",
     "transformer_pde.solvers.options", "transformer_pde.solvers.recorded"},
    {"transformer_pde.solvers.loop"},  # the run loop of every stepping solver (progress, callbacks, checkpoints)
    {"transformer_pde.solvers.solver"},  # the base class of the solver objects
    {"transformer_pde.solvers.jko.transport"},  # the Lagrangian JKO's transport terms and inner optimiser
    {"transformer_pde.solvers.particle.evaluator"},  # the field evaluation and common scale of a particle solve
    {"transformer_pde.solvers.particle.fixed_step", "transformer_pde.solvers.particle.adaptive"},  # the particle solves
    # the two JKO steps; Θ_t at the JKO times
    {"transformer_pde.solvers.jko.lagrangian", "transformer_pde.solvers.jko.eulerian",
     "transformer_pde.solvers.jko.theta"},
    {"transformer_pde.solvers.jko.problem"},  # the checked JKO problem
    {"transformer_pde.solvers.jko.run"},  # the run shared by the JKO variants: layout, ledger, records
    {"transformer_pde.solvers.jko.methods"},  # LagrangianJKO, EulerianJKO (they run themselves)
    {"transformer_pde.solvers.solve"},  # tp.solve
    # the solver objects that run themselves, each with its keyword front end (which calls tp.solve):
    # FixedStep/Euler/Heun/RK4/Dopri5 and tp.simulate; ShardedEuler and simulate_sharded; tp.jko
    {"transformer_pde.solvers.particle.methods", "transformer_pde.solvers.particle.sharded",
     "transformer_pde.solvers.jko.front"},
    {"transformer_pde.solvers.particle.drift"},  # DriftEuler: projected Euler with a token-wise drift
    {"transformer_pde.solvers.particle.front"},  # tp.simulate, the particle solvers' keyword front end
    {"transformer_pde.nn.modules"},  # MeanFieldAttention: continuous-depth attention whose forward is a solve
    {"transformer_pde.nn"},  # tp.nn: the torch.nn converters and the module
    # Lipschitz and Grönwall constants, fast-weights coefficients; linear stability of the uniform measure
    {"transformer_pde.analysis.theory.stability", "transformer_pde.analysis.theory.noise",
     "transformer_pde.analysis.theory.circle", "transformer_pde.analysis.theory.kinetic"},
    # worst-case flow sensitivity and trajectory bounds; stationary mean-field branches (continuation)
    # the theorems' limit objects (ω-limit Hessian, fast-weights SDE)
    {"transformer_pde.analysis.theory.sensitivity", "transformer_pde.analysis.theory.continuation",
     "transformer_pde.analysis.theory.limits", "transformer_pde.analysis.theory.homogenized"},
    # the critical attention scaling (closed forms, almost-simplex samplers); synchronisation on the circle
    {"transformer_pde.analysis.theory.scaling", "transformer_pde.analysis.theory.synchronization"},
    # generic diagnostics; closed forms
    {"transformer_pde.analysis.clustering", "transformer_pde.analysis.ensembles", "transformer_pde.analysis.theory",
     "transformer_pde.analysis.pretrained"},
    {"transformer_pde.analysis.pretrained_drift"},  # the continuous rung with the feed-forward as a drift
    {"transformer_pde.analysis.pretrained_subsets"},  # every subset of the ladder's ingredients removed together
    {"transformer_pde.analysis.theory.particles"},  # the particle diagnostics of the theory
    # attention entropy and orthogonal heads; the flat flow and clustering hitting times
    {"transformer_pde.analysis.theory.attention_geometry", "transformer_pde.analysis.theory.flows"},
    {"transformer_pde.analysis.diagnostics"},  # tp.diagnostics = theory.particles
    {"transformer_pde"},  # the public facade (import transformer_pde as tp)
    {"transformer_pde.application.plotting"},
    {"transformer_pde.application.animation"},
    {"transformer_pde.application.studies"},
    {"transformer_pde.application.studies.claims"},  # the claims list of metrics.json
    {"transformer_pde.application.studies.provenance"},  # the code fingerprint a published table carries
    {"transformer_pde.application.studies.retrieval"},  # the retrieval profile measured on particles and networks
    {"transformer_pde.application.studies.paper_dtype"},  # the paper study's numbers, float32 against float64
    {"transformer_pde.application.studies.noisy_hysteresis"},  # the hysteresis sweeps of the noisy study
    {f"transformer_pde.application.studies.{m}" for m in ("demo", "paper", "theory", "jko", "clustering", "causal",
                                                          "layernorm", "noisy", "training", "critical_scaling",
                                                          "repulsive", "lost_in_the_middle", "homogenized")},
    {"transformer_pde.application.studies.theory_energy",  # the theory studies on the parts of studies.theory
     "transformer_pde.application.studies.theory_clustering"},
    {"transformer_pde.application.studies.theorems_stability"},  # uses studies.jko's slope fit
    {"transformer_pde.application.studies.theorems"},  # registers the stability studies; composes studies.jko
    # the pretrained-network probe: its measurements and figures, then the study
    {"transformer_pde.application.studies.probe", "transformer_pde.application.studies.pretrained_figures"},
    {"transformer_pde.application.studies.probe_subsets",  # the order-free ladder and its Shapley shares
     "transformer_pde.application.studies.probe_reinit"},  # the architecture re-initialised, side by side
    {"transformer_pde.application.studies.pretrained"},
    # a run's config and limits; the run directory's files; its lock
    {"transformer_pde.application.config", "transformer_pde.application.rundir", "transformer_pde.application.locks"},
    {"transformer_pde.application.runs"},  # plan and execute a study in its run directory
    {"transformer_pde.application.sweep"},
    {"transformer_pde.application.cli"},
]
RANK = {m: i for i, layer in enumerate(LAYERS) for m in layer}

# the sub-packages, lowest first; the facade (transformer_pde/__init__.py) sits between analysis and application
SUBPACKAGES = ["utils", "model", "processes", "dynamics", "solvers", "nn", "analysis", "", "application"]


def subpackage_rank(module: str) -> int:
    parts = module.split(".")
    return SUBPACKAGES.index(parts[1] if len(parts) > 1 else "")


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


def test_subpackages_import_downwards_only():
    bad = [f"{src}:{line} imports {dst} ({dst.split('.')[1] if '.' in dst else 'the facade'} is above "
           f"{src.split('.')[1] if '.' in src else 'the facade'})"
           for src, dst, _, line in import_edges() if subpackage_rank(dst) > subpackage_rank(src)]
    assert not bad, "\n".join(bad)


def test_every_module_lives_in_a_subpackage():
    """The package root holds only the facade; every other module belongs to a layer's sub-package."""
    root = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert not root, f"move these into utils/, model/, processes/, dynamics/, solvers/, analysis/ or application/: {root}"
    assert sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()) == sorted(
        s for s in SUBPACKAGES if s)


def _private_attributes(tree) -> set:
    """The ``_private`` attribute names a module defines: methods and nested classes, class-level
    names, ``__slots__`` entries, and attributes it assigns (``obj._x = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    names.add(t.id)
                    if t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                        names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            names.add(node.args[1].value)
    return {n for n in names if isinstance(n, str) and n.startswith("_") and not n.startswith("__")}


def private_attribute_uses():
    """(module, line, attribute, defining modules) for every ``x._a`` in a module that does not define
    ``_a`` itself while another module of the package does."""
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in _modules().items()}
    defined = {name: _private_attributes(tree) for name, tree in trees.items()}
    out = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if node.attr in defined[name]:
                    continue
                owners = sorted(m for m, attrs in defined.items() if m != name and node.attr in attrs)
                if owners:
                    out.append((name, node.lineno, node.attr, owners))
    return out


def test_no_private_attribute_crosses_modules():
    bad = [f"{src}:{line} uses .{attr}, a private attribute of {', '.join(owners)}"
           for src, line, attr, owners in private_attribute_uses()]
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_modules():
    bad = [f"{src}:{line} imports {name} from {dst}" for src, dst, name, line in import_edges()
           if name and name.startswith("_") and not name.startswith("__") and src != dst]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["model.field", "model.transport", "model.heads", "model.backends", "model.moments",
                                    "model.softmax", "solvers.particle.methods",
                                    "solvers.parts", "dynamics.layernorm", "solvers.jko.lbfgs", "solvers.jko.lagrangian",
                                    "solvers.jko.eulerian"])
def test_internal_api_is_named_and_exists(module):
    import importlib

    mod = importlib.import_module(f"transformer_pde.{module}")
    internal = getattr(mod, "__internal__")
    assert internal and all(hasattr(mod, n) and not n.startswith("_") for n in internal)


def test_checker_sees_a_cycle_and_a_private_import(tmp_path, monkeypatch):
    """The checks can fail: a fake heads module that imports the solver, a private name and a private
    attribute of another module is caught, and so is a module at the package root."""
    fake = tmp_path / "transformer_pde"
    for sub in ("model", "solvers"):
        (fake / sub).mkdir(parents=True)
        (fake / sub / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "solvers" / "particle.py").write_text("from ..model.heads import Heads\n\n\ndef g(h):\n    return h._ref\n")
    (fake / "model" / "heads.py").write_text("def f():\n    from ..solvers.particle import _WeightDriver\n\n\n"
                                             "class Heads:\n    _ref = None\n")
    (fake / "stray.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    edges = import_edges()
    assert ("transformer_pde.model.heads", "transformer_pde.solvers.particle", "_WeightDriver", 2) in edges
    with pytest.raises(AssertionError, match="heads:2 imports transformer_pde.solvers.particle"):
        test_imports_flow_downwards_only()
    with pytest.raises(AssertionError, match="heads:2 imports transformer_pde.solvers.particle .solvers is above model"):
        test_subpackages_import_downwards_only()
    with pytest.raises(AssertionError, match="imports _WeightDriver"):
        test_no_private_name_crosses_modules()
    with pytest.raises(AssertionError, match=r"particle:5 uses \._ref, a private attribute of transformer_pde.model.heads"):
        test_no_private_attribute_crosses_modules()
    with pytest.raises(AssertionError, match="stray.py"):
        test_every_module_lives_in_a_subpackage()


# ---------------------------------------------------------------------------- module size and parameter lists
#: the most lines a module may have (one concern per module)
MAX_MODULE_LINES = 700
#: the most parameters an internal function may take: more means a keyword list re-threaded through the
#: layers, where an object (Model, solver, SolveOptions, a checked-problem dataclass) should travel instead
MAX_PARAMETERS = 12
#: the public entry points whose keywords are the user's interface (each builds the objects and calls tp.solve,
#: or is a constructor whose settings are its fields)
KEYWORD_FRONT_ENDS = {
    "transformer_pde.solvers.particle.front.simulate", "transformer_pde.solvers.particle.sharded.simulate_sharded",
    "transformer_pde.solvers.jko.front.jko",
    "transformer_pde.solvers.solve.solve", "transformer_pde.analysis.ensembles.simulate",
    "transformer_pde.model.field.evaluate", "transformer_pde.application.sweep.run_sweep",
    "transformer_pde.application.animation.animate_tokens",
    "transformer_pde.nn.modules.MeanFieldAttention.__init__", "transformer_pde.nn.modules.TransformerFlow.__init__",
}


def _parameter_count(fn) -> int:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def long_parameter_lists(pkg: Path = None):
    """(qualified name, count) of every function of the package over MAX_PARAMETERS parameters."""
    pkg = PKG if pkg is None else pkg
    out = []
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = ".".join(parts)

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}.{child.name}")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}.{child.name}"
                    if _parameter_count(child) > MAX_PARAMETERS and name not in KEYWORD_FRONT_ENDS:
                        out.append((name, _parameter_count(child)))
                    visit(child, name)

        visit(ast.parse(path.read_text(encoding="utf-8")), module)
    return out


def long_modules(pkg: Path = None):
    """(file relative to the package's parent, lines) of every module over MAX_MODULE_LINES lines."""
    pkg = PKG if pkg is None else pkg
    sizes = {str(p.relative_to(pkg.parent)): len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted(pkg.rglob("*.py"))}
    return [(name, n) for name, n in sizes.items() if n > MAX_MODULE_LINES]


def test_no_module_over_the_line_limit():
    bad = [f"{name}: {n} lines" for name, n in long_modules()]
    assert not bad, f"split these modules (one concern each, at most {MAX_MODULE_LINES} lines):\n" + "\n".join(bad)


def test_no_keyword_rethreading():
    bad = [f"{name}: {n} parameters" for name, n in long_parameter_lists()]
    assert not bad, (f"internal functions take at most {MAX_PARAMETERS} parameters; pass the objects "
                     f"(Model, solver, SolveOptions, a checked problem) instead:\n" + "\n".join(bad))


def test_the_size_checks_can_fail(tmp_path):
    """A fake package with a 13-parameter internal function and a 701-line module is caught; a keyword
    front end of the allow-list is not."""
    fake = tmp_path / "transformer_pde"
    (fake / "solvers" / "particle").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    params = ", ".join(f"a{i}" for i in range(13))
    (fake / "solvers" / "particle" / "front.py").write_text(
        f"def _inner({params}):\n    pass\n\n\ndef simulate({params}):\n    pass\n\n\n"
        f"class C:\n    def method(self, {', '.join(f'b{i}' for i in range(12))}):\n        pass\n"
        + "\n" * 700)
    assert long_parameter_lists(fake) == [("transformer_pde.solvers.particle.front._inner", 13)]
    assert long_modules(fake) == [(str(Path("transformer_pde", "solvers", "particle", "front.py")), 711)]


def direction_defaults(pkg: Path = None):
    """(module:line, default source) of every ``direction`` parameter or field whose default is not the
    constant DEFAULT_DIRECTION."""
    pkg = PKG if pkg is None else pkg
    out = []
    for path in sorted(pkg.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            found = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pos = a.posonlyargs + a.args
                found = [(p, d) for p, d in zip(pos[len(pos) - len(a.defaults):], a.defaults)]
                found += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                found = [d for p, d in found if p.arg == "direction"]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == "direction" and node.value is not None:
                found = [node.value]
            for d in found:
                if not (isinstance(d, ast.Name) and d.id == "DEFAULT_DIRECTION"):
                    out.append((f"{path.relative_to(pkg.parent)}:{d.lineno}", ast.unparse(d)))
    return out


def test_one_direction_default_across_the_api(tmp_path):
    """Every ``direction=`` of the package defaults to utils.validation.DEFAULT_DIRECTION (the README states
    it), and the check sees a literal default in a fake module."""
    from transformer_pde.utils.validation import DEFAULT_DIRECTION
    import transformer_pde as tp
    import inspect

    assert not direction_defaults(), direction_defaults()
    assert DEFAULT_DIRECTION == "ascent" and f'default direction is `"{DEFAULT_DIRECTION}"`' in \
        (PKG.parent / "README.md").read_text(encoding="utf-8")
    for fn in (tp.simulate, tp.jko, tp.velocity, tp.slope, tp.dissipation):
        assert inspect.signature(fn).parameters["direction"].default == DEFAULT_DIRECTION, fn.__name__
    assert tp.Model(tp.Heads.scalar([1.0], 3)).direction == DEFAULT_DIRECTION
    fake = tmp_path / "transformer_pde"
    fake.mkdir()
    (fake / "m.py").write_text('def f(x, direction="descent"):\n    pass\n')
    assert direction_defaults(fake) == [(str(Path("transformer_pde", "m.py")) + ":1", "'descent'")]
