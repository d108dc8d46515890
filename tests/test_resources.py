"""transformer_pde.utils.resources: the shipped configs and TOML reading.  The configs found are the files of
the source tree's experiments/ (read here with pathlib, independently of the lookup), every one of them
parses, and a config is found by name, by name.toml, by the README's experiments/ path and by path."""

from pathlib import Path

import pytest

from transformer_pde.utils import resources

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def test_config_names_are_the_toml_files_of_experiments():
    names = resources.config_names()
    assert names == sorted(p.stem for p in EXPERIMENTS.glob("*.toml"))
    assert names, "no shipped configs"
    # the package data of a wheel or the checkout's experiments/: the same files either way
    assert sorted(p.name for p in resources.config_dir().glob("*.toml")) == sorted(p.name for p in EXPERIMENTS.glob("*.toml"))


def test_every_shipped_config_parses_to_the_same_dict_as_its_text():
    for name in resources.config_names():
        path = resources.config_path(name)
        assert path.suffix == ".toml" and path.is_file()
        cfg = resources.load_toml(path)
        assert isinstance(cfg, dict) and cfg
        assert cfg == resources.loads_toml(path.read_text(encoding="utf-8"))


def test_find_config_accepts_a_name_a_toml_name_the_readme_path_and_a_path(tmp_path):
    name = resources.config_names()[0]
    want = resources.config_path(name)
    for spelling in (name, name + ".toml", f"experiments/{name}.toml"):
        assert resources.find_config(spelling).resolve() == want.resolve(), spelling
    own = tmp_path / "mine.toml"
    own.write_text('kind = "x"\n[params]\nn = 3\n')
    assert resources.find_config(own) == own
    assert resources.load_toml(own) == {"kind": "x", "params": {"n": 3}}


def test_loads_toml_values_and_its_decode_error():
    assert resources.loads_toml('a = 1.5\nb = [1, 2]\n[t]\nc = "s"\n') == {"a": 1.5, "b": [1, 2], "t": {"c": "s"}}
    with pytest.raises(resources.tomllib.TOMLDecodeError):
        resources.loads_toml("a = = 1")


@pytest.mark.parametrize("bad,err,match", [
    (3, TypeError, "config name must be a string"),
    ("../x", ValueError, "is not a plain name"),
    (".hidden", ValueError, "is not a plain name"),
    ("no_such_config", ValueError, "no shipped config named 'no_such_config'; available: "),
])
def test_config_path_refuses_bad_names(bad, err, match):
    with pytest.raises(err, match=match):
        resources.config_path(bad)
