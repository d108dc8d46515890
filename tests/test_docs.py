"""The documentation site: its API reference covers every public name, its link check can fail,
and (slow) the whole site builds from a clean tree with warnings as errors."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import transformer_pde

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
sys.path.insert(0, str(ROOT / "scripts"))
import apigen  # noqa: E402
import build_docs  # noqa: E402


def _members_of(page: str) -> set[str]:
    found = set()
    for m in re.finditer(r":members: (.+)", page):
        found |= {n.strip() for n in m.group(1).split(",")}
    return found


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    apigen.write(out)
    return out


def test_every_top_level_name_has_a_page(api):
    index = (api / "index.rst").read_text()
    for name in transformer_pde.__all__:
        value = getattr(transformer_pde, name)
        if isinstance(value, type(transformer_pde)):
            assert f"api-{value.__name__}" in index and (api / f"{value.__name__}.rst").exists(), name
            continue
        page = api / "generated" / f"transformer_pde.{name}.rst"
        assert page.exists(), name
        text = page.read_text()
        assert re.search(rf"^\.\. auto(function|class|exception|data):: {re.escape(name)}$", text, re.M), text
        assert f"generated/transformer_pde.{name}" in index


def test_every_submodule_all_is_covered(api):
    """Each name of each public module's __all__ is documented on that module's page (automodule
    :members:) or on the single page of the same object elsewhere, which the module page links."""
    plan = apigen.plan()
    modules = apigen.public_modules()
    for required in ("transformer_pde.analysis.theory", "transformer_pde.analysis.diagnostics", "transformer_pde.analysis.clustering",
                     "transformer_pde.analysis.ensembles", "transformer_pde.processes.weights", "transformer_pde.solvers.particle.methods",
                     "transformer_pde.solvers.jko.front", "transformer_pde.model.sphere", "transformer_pde.model.transport"):
        assert required in modules, required
    pages = {p.stem: p.read_text() for p in api.glob("*.rst")}
    generated = {p.stem for p in (api / "generated").glob("*.rst")}
    for modname in modules[1:]:  # modules[0] is the package: test_every_top_level_name_has_a_page
        mod = importlib.import_module(modname)
        names = [n for n in getattr(mod, "__all__", []) if not isinstance(getattr(mod, n), type(transformer_pde))]
        page = pages[modname]
        own = _members_of(page)
        for n in names:
            target = plan[modname][n]
            if target == f"{modname}.{n}":
                assert n in own, f"{modname}.{n} is not in the :members: of its page"
            else:
                assert f":py:obj:`{target}`" in page, f"{modname}.{n}: no link to {target}"
                home_mod, _, home_name = target.rpartition(".")
                assert target in generated or home_name in _members_of(pages[home_mod]), target
                assert getattr(importlib.import_module(home_mod), home_name) is getattr(mod, n)


def test_new_modules_and_names_appear_without_editing_the_docs(monkeypatch, tmp_path):
    # a module added to the package and a name added to tp.__all__ get pages at the next build
    pkg_dir = Path(transformer_pde.__file__).parent
    mod = type(transformer_pde)("transformer_pde.fake_topic")
    mod.__all__ = ["fake_function"]

    def fake_function(x):
        """Fake: x ↦ x."""
        return x

    fake_function.__module__ = "transformer_pde.fake_topic"
    mod.fake_function = fake_function
    monkeypatch.setitem(sys.modules, "transformer_pde.fake_topic", mod)
    monkeypatch.setattr(apigen, "public_modules", lambda package=apigen.PACKAGE, _orig=apigen.public_modules:
                        _orig(package) + ["transformer_pde.fake_topic"])
    monkeypatch.setattr(transformer_pde, "fake_function", fake_function, raising=False)
    monkeypatch.setattr(transformer_pde, "__all__", transformer_pde.__all__ + ["fake_function"])
    apigen.write(tmp_path)
    assert (tmp_path / "generated" / "transformer_pde.fake_function.rst").exists()
    assert ":py:obj:`transformer_pde.fake_function`" in (tmp_path / "transformer_pde.fake_topic.rst").read_text()
    assert pkg_dir.exists()


def test_link_check_finds_broken_links_and_missing_images(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "img.png").write_bytes(b"\x89PNG")
    (tmp_path / "index.html").write_text(
        '<html><body><a href="sub/page.html#here">ok</a><a href="sub/page.html#gone">bad anchor</a>'
        '<a href="missing.html">missing</a><img src="img.png"><img src="nope.png">'
        '<a href="https://example.org/x">external</a><a href="#top" id="top">self</a></body></html>')
    (tmp_path / "sub" / "page.html").write_text('<html><body><h1 id="here">x</h1><a href="../index.html">up</a></body></html>')
    problems = build_docs.check_links(tmp_path)
    assert len(problems) == 3, problems
    assert any("gone" in p for p in problems) and any("missing.html" in p for p in problems)
    assert any("nope.png" in p for p in problems)


def test_gallery_examples_are_public_api_scripts():
    gallery = sorted((ROOT / "docs" / "gallery").glob("plot_*.py"))
    assert len(gallery) >= 10
    for f in gallery:
        text = f.read_text()
        assert text.startswith('"""'), f"{f.name}: sphinx-gallery needs a docstring title first"
        assert "transformer_pde" in text
        assert not re.search(r"from transformer_pde\.\w*\s+import\s+_|transformer_pde\.\w+\._", text), f.name


@pytest.mark.slow
def test_docs_build_from_clean_tree():
    """The one command: Sphinx with -W (every gallery example executed), then the link check."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_docs.py"), "--clean"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    html = ROOT / "docs" / "_build" / "html"
    for page in ("index.html", "model.html", "api/index.html", "api/generated/transformer_pde.simulate.html",
                 "auto_examples/index.html", "auto_examples/plot_ou_vs_oscillating.html"):
        assert (html / page).exists(), page
    simulate = (html / "api/generated/transformer_pde.simulate.html").read_text()
    assert 'id="transformer_pde.simulate"' in simulate and "Parameters" in simulate
    examples = sorted(p.stem for p in (ROOT / "docs" / "gallery").glob("plot_*.py"))
    assert len(examples) >= 10
    for name in examples:  # one figure each
        assert (html / "_images" / f"sphx_glr_{name}_001.png").exists(), name
        assert not (html / "_images" / f"sphx_glr_{name}_002.png").exists(), f"{name} makes more than one figure"


def _readme_blocks(after: str, count: int):
    text = (ROOT / "README.md").read_text()
    tail = text[text.index(after):]
    return re.findall(r"```python\n(.*?)```", tail, re.S)[:count]


def test_the_readme_quick_start_runs_as_written():
    # the quick start and the composable-core block after it, executed as a reader would paste them
    scope: dict = {}
    with transformer_pde.thread_policy(None):  # the block sets the process's thread policy: restored on exit
        for i, block in enumerate(_readme_blocks("## Quick start", 2)):
            exec(compile(block, f"README.md[quick start {i}]", "exec"), scope)
    assert tuple(scope["traj"].x.shape[1:]) == (4, 60, 3)
    assert tuple(scope["jko"].x.shape[:2]) == (5, 4)  # t = 0, 0.05, ..., 0.2 for 4 paths


def test_the_readme_says_how_to_install_the_cpu_build_on_each_platform():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Installing PyTorch"):text.index("**Documentation:**")]
    rows = {r.split("|")[1].strip(): r for r in section.splitlines() if r.startswith("| ") and "---" not in r}
    assert "--index-url https://download.pytorch.org/whl/cpu" in rows["Linux"].split("|")[2]
    for platform in ("macOS", "Windows"):
        assert "pip install torch`" in rows[platform].split("|")[2]
    assert "torch==" not in text  # no pin that a CPU-only user would follow into the CUDA build
