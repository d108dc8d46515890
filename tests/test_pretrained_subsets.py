"""The order-free ladder (transformer_pde.analysis.pretrained_subsets, studies.probe_subsets): every subset of the
four ingredients removed together, and the Shapley shares of the gap.

Oracles: the ladder's own rungs (tp.pretrained.ladder, a separate code path, the continuous one through
tp.solve), the network's block (dt = 1 of the continuous LayerNorm sublayers is the discrete block), Euler's
order 1 in dt, and Shapley values by brute force over the 4! orders of removal."""

import itertools
from pathlib import Path
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import transformer_pde as tp
from transformer_pde.analysis import pretrained_subsets as ps
from transformer_pde.application.studies.probe_subsets import shapley_summary

from test_pretrained import _inputs, _tiny, _tol, needs_transformers

RUNG_OF = {(): "network", ("feedforward",): "no_feedforward", ("feedforward", "layernorm"): "sphere",
           ("feedforward", "layernorm", "bias"): "no_bias", ps.INGREDIENTS: "continuous"}


@needs_transformers
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_ladders_rungs_are_subsets(dtype):
    """The five rungs of tp.pretrained.ladder are the subsets {}, {ff}, {ff, LN}, {ff, LN, bias} and all four
    (the continuous rung, computed by tp.solve, equal from ℓ = 1 on: its entry 0 is the projected embeddings)."""
    net = tp.pretrained.load(_tiny("bert"), dtype=dtype)
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert", dtype))
    lad = tp.pretrained.ladder(net, states, mask, dt=1 / 4)
    m = mask[None, ..., None]
    for S, rung in RUNG_OF.items():
        got = ps.subset_rollout(net, states[0], mask, S, dt=1 / 4)
        assert got.shape == states.shape
        assert_close(got[1:] * m, lad[rung][1:] * m, **_tol(states, 400.0)), rung
    assert ps.subset_name(()) == "network" and ps.subset_name(ps.INGREDIENTS) == "no_ff+sphere+no_bias+continuous"
    assert len(ps.SUBSETS) == 16 and len(set(ps.SUBSETS)) == 16


@needs_transformers
def test_continuous_sublayers_one_step_is_the_block_and_converge_at_order_one():
    """With LayerNorm kept, dt = 1 of the continuous sublayers is the network's block exactly; as dt → 0 every
    continuous subset converges at Euler's order 1 (errors against dt = 1/64 halve with dt)."""
    net = tp.pretrained.load(_tiny("bert"), dtype=torch.float64)
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert", torch.float64))
    m = mask[..., None]
    x = states[1]
    for keep_ff in (True, False):
        S = {"discrete"} | (set() if keep_ff else {"feedforward"})
        assert_close(ps.subset_layer_map(net, 1, x, mask, S, dt=1.0) * m,
                     ps.subset_layer_map(net, 1, x, mask, S - {"discrete"}) * m, **_tol(x))
    for S in ({"discrete"}, {"discrete", "layernorm"}, {"discrete", "layernorm", "bias"}):
        ref = ps.subset_layer_map(net, 0, states[0], mask, S, dt=1 / 64)
        errs = [float(((ps.subset_layer_map(net, 0, states[0], mask, S, dt=h) - ref) * m).norm())
                for h in (1 / 4, 1 / 8)]
        assert 1.6 < errs[0] / errs[1] < 2.6, (S, errs)


@needs_transformers
def test_refusals():
    net = tp.pretrained.load(_tiny("bert"))
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert"))
    with pytest.raises(ValueError, match="unknown ingredients"):
        ps.subset_layer_map(net, 0, states[0], mask, {"dropout"})
    with pytest.raises(TypeError, match="collection of ingredients"):
        ps.subset_layer_map(net, 0, states[0], mask, "feedforward")
    with pytest.raises(ValueError, match="dt must be 1/N"):
        ps.subset_layer_map(net, 0, states[0], mask, {"discrete"}, dt=0.3)
    gpt = tp.pretrained.load(_tiny("gpt2"))
    s2, m2 = tp.pretrained.hidden_states(gpt, _inputs("gpt2"))
    with pytest.raises(ValueError, match="post-LN"):
        ps.subset_layer_map(gpt, 0, s2[0], m2, {"bias"})


def _brute_force(v, players):
    """φ_i = mean over the N! orders of removal of v(before ∪ {i}) − v(before)."""
    out = {i: 0.0 for i in players}
    orders = list(itertools.permutations(players))
    for order in orders:
        for k, i in enumerate(order):
            before = frozenset(order[:k])
            out[i] += (v[before | {i}] - v[before]) / len(orders)
    return out


def test_shapley_values_against_the_orders_of_removal():
    """Random games on the four ingredients: the weighted sum over subsets equals the mean over the 24 orders,
    the values add up to v(all) − v(∅), an additive game gives each player its own effect, and a player that
    changes nothing gets 0."""
    rng = np.random.default_rng(0)
    players = ps.INGREDIENTS
    for _ in range(5):
        v = {S: torch.tensor(rng.normal(), dtype=torch.float64) for S in ps.SUBSETS}
        got = ps.shapley_values(v)
        want = _brute_force({S: float(t) for S, t in v.items()}, players)
        for i in players:
            assert math.isclose(float(got[i]), want[i], rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(sum(float(t) for t in got.values()), float(v[frozenset(players)] - v[frozenset()]),
                            rel_tol=1e-12, abs_tol=1e-12)
    effect = dict(zip(players, (1.0, 2.0, -0.5, 0.0)))
    add = {S: torch.tensor(sum(effect[i] for i in S), dtype=torch.float64) for S in ps.SUBSETS}
    got = ps.shapley_values(add)
    assert all(math.isclose(float(got[i]), effect[i], abs_tol=1e-12) for i in players)
    with pytest.raises(ValueError, match="lacks the subsets"):
        ps.shapley_values({frozenset(): torch.tensor(0.0)})


def test_shapley_summary_bootstrap_and_shares():
    """Per-sentence games with known mean Shapley values: the bootstrap intervals cover them, the shares of the
    defined totals add up to 1, and a zero total (ℓ = 0) has no share."""
    rng = np.random.default_rng(1)
    S_n, L1 = 200, 3
    effect = {"feedforward": 0.3, "layernorm": 0.6, "bias": 0.05, "discrete": 0.05}
    noise = {i: rng.normal(0, 0.2, size=(L1, S_n)) for i in ps.INGREDIENTS}
    stats = {}
    for S in ps.SUBSETS:
        v = sum((effect[i] + noise[i]) for i in S) if S else np.zeros((L1, S_n))
        v = np.array(v) * np.array([0.0, 1.0, 2.0])[:, None]
        t = torch.as_tensor(v)
        stats[ps.subset_name(S)] = {k: t for k in ("w2", "mean_angle", "mean_cosine", "pair_fraction", "clusters")}
    out = shapley_summary(stats, seed=0, resamples=300)
    sh = out["shapley"]["w2"]
    for i in ps.INGREDIENTS:
        for l in (1, 2):
            want = effect[i] * l
            assert abs(sh[i]["value"][l] - want) <= 3 * sh[i]["value_error"][l] + 1e-12, (i, l)
        assert sh[i]["share"][0] is None
    for l in (1, 2):
        assert math.isclose(sum(sh[i]["share"][l] for i in ps.INGREDIENTS), 1.0, rel_tol=1e-9)


@needs_transformers
def test_reinitialised_architecture_is_seeded_and_fresh():
    """The re-initialised network has the trained one's architecture and fresh weights from its configuration's
    initialiser: the same seed gives the same weights, another seed others, the global generator is untouched;
    summarise_seeds is the mean and standard error over seeds of the per-seed sentence means."""
    from transformer_pde.application.studies.probe_reinit import reinitialised, summarise_seeds

    net = tp.pretrained.load(_tiny("bert"))
    state = torch.random.get_rng_state()
    a, b, c = reinitialised(net, 0), reinitialised(net, 0), reinitialised(net, 1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a.num_layers == net.num_layers and a.dim == net.dim and a.num_heads == net.num_heads
    tol = 8 * torch.finfo(a.layers[1].query.dtype).eps  # the same draws, up to the arithmetic around them
    torch.testing.assert_close(a.layers[1].query, b.layers[1].query, rtol=tol, atol=tol)
    assert float((a.layers[1].query - c.layers[1].query).abs().max()) > 1e3 * tol  # independent draws
    assert not torch.allclose(reinitialised(net, 7).layers[1].query, net.layers[1].query)  # _tiny is seed 0
    # BERT's initialiser: normal(0, initializer_range) weights, zero biases, unit LayerNorm gains
    std = float(a.layers[0].query.std())
    assert abs(std - net.model.config.initializer_range) < 0.2 * net.model.config.initializer_range
    assert float(a.layers[0].query_bias.abs().max()) == 0.0 and bool((a.layers[0].norm1.gain == 1).all())
    per = [{"x": torch.tensor([[1.0, 3.0], [2.0, 2.0]], dtype=torch.float64)},
           {"x": torch.tensor([[3.0, 5.0], [4.0, 4.0]], dtype=torch.float64)}]
    s = summarise_seeds(per, [0, 1])
    assert s["x"]["per_seed"] == [[2.0, 2.0], [4.0, 4.0]] and s["x"]["mean"] == [3.0, 3.0]
    assert math.isclose(s["x"]["se"][0], 1.0) and s["seeds"] == [0, 1]


@needs_transformers
def test_surrogate_script_unfitted_is_the_continuous_rung():
    """scripts/probe_surrogate.py: with its parameters at their start (β factor 1, layer time 1, value gain 1,
    no feed-forward) the surrogate's rollout is the ladder's continuous rung (tp.solve, a separate path); a
    feed-forward gain moves it, and the gradient reaches every parameter."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import probe_surrogate

    net = tp.pretrained.load(_tiny("bert"), dtype=torch.float64)
    states, mask = tp.pretrained.hidden_states(net, _inputs("bert", torch.float64))
    x0 = torch.nn.functional.normalize(states[0], dim=-1)
    theta0 = torch.tensor([[0.0, 0.0, 1.0, 0.0]] * net.num_layers, dtype=torch.float64)
    got = probe_surrogate.rollout(net, x0, mask, theta0, 4)
    ref = tp.pretrained.ladder(net, states, mask, rungs=("continuous",), dt=1 / 4)["continuous"]
    m = mask[None, ..., None]
    assert_close(got[1:] * m * math.sqrt(net.dim), ref[1:] * m, **_tol(states, 400.0))
    theta = theta0.clone()
    theta[:, 3] = 0.5
    theta.requires_grad_(True)
    moved = probe_surrogate.rollout(net, x0, mask, theta, 4)
    assert float(((moved.detach() - got) * m).abs().max()) > 1e-3
    probe_surrogate._loss(moved, torch.nn.functional.normalize(states, dim=-1), mask).backward()
    assert bool((theta.grad.abs().sum(0) > 0).all())
