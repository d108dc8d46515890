"""Probe of the token dynamics of a real pretrained transformer (kind ``pretrained_probe``; docs/pretrained.md).

The sentences are English prose that ships with Python (the help topics of :mod:`pydoc_data.topics`,
split by :func:`~transformer_pde.application.studies.probe.split_sentences`, ``sentences`` of them drawn
by a seeded permutation) fed to the network (default: the packaged all-MiniLM-L6-v2, a 6-layer post-LN
BERT).  The network's hidden states x_l (l = 0..L, special tokens included) are the "real" tokens.

Per hidden-state index l: the clustering statistics of the normalised tokens x̂ = x/|x| of each
sentence (mean cosine over distinct pairs, pair fraction and single-linkage cluster count at the
chordal ``radius``), averaged over sentences with their standard error.

Per layer l (the map x_l → x_{l+1}):

* β_eff, the inverse temperature of the isotropic kernel softmax_j(β⟨x̂_i, x̂_j⟩) closest in mean KL
  to the layer's head-averaged attention probabilities, fitted per sentence (:func:`probe.fit_effective_beta`);
* log E_β of the layer's own heads (biases dropped, ω_h = 1, β = r²/√k with r the sentence's RMS
  token norm at that layer) on the normalised tokens before (x̂_l) and after (x̂_{l+1}) the layer;
* the local Lipschitz constant ‖∂x_{l+1}/∂x_l‖₂ of the exact layer map at the real tokens of a seeded
  subset of ``lipschitz_sentences`` sentences (:func:`_lipschitz_subset`; power iteration with a stopping
  rule, :func:`probe.top_singular_value`), with its standard error over the subset.

The ladder: each rung of :data:`transformer_pde.pretrained.RUNGS` (the exact network map, then one
ingredient of the mean-field picture more per rung) is rolled out from the real embeddings x_0
(``mode = "rollout"``) or applied to the real x_l one layer at a time (``"local"``); per rung and
hidden-state index: W2 between the normalised token clouds and the mean angle to the real tokens
(:func:`transformer_pde.pretrained.cloud_distances`), and the same clustering statistics.  Nothing
is fitted to make a rung agree.

The sentences are processed in ``buckets`` groups of similar token length (sorted, contiguous), each
one batched forward and one batched solve per rung; every bucket is stored under data/ and reused on
``--resume``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import List

import torch

import transformer_pde as tp

from . import Option, at_least, dtype_of, fingerprint, load_segment, positive, segment_bar, study, unique_nonempty
from .probe import cloud_statistics, factored_log_energy, fit_effective_beta, select_sentences, sentence_w2, \
    standard_error, top_singular_value, topic_sentences
from .pretrained_figures import figures
from .provenance import code_fingerprint
from .probe_reinit import reinit_figure, reinit_statistics, reinitialised, summarise_seeds
from .probe_subsets import SUBSET_METRICS, shapley_figure, shapley_summary, subset_statistics
from ...processes.model_files import check_model_folder, package_zip, weights_fingerprint

log = logging.getLogger(__name__)

__all__ = ["RUNG_NAMES", "run_pretrained_probe"]

#: the rungs of the ladder, in order (the same names as ``tp.pretrained.RUNGS``)
RUNG_NAMES = ("network", "no_feedforward", "sphere", "no_bias", "continuous")
_STATS = ("mean_cosine", "pair_fraction", "clusters")
_MINILM_POSITIONS = 512  # the position embeddings of the packaged all-MiniLM-L6-v2 (its checksum fixes them)


def _model_name(v):
    return None if v.strip() else "must name 'minilm' or a local model folder"


def _unit_divisor(v):
    k = 1.0 / v
    return None if 0 < v <= 1 and abs(k - round(k)) < 1e-9 else "must be 1/k for a whole number k >= 1 (e.g. 0.25)"


OPTIONS = {
    "model": Option("minilm", (str,), "'minilm' = the packaged all-MiniLM-L6-v2 (extracted into cache_dir), or the "
                    "path of a local transformers model folder (BERT, GPT-2 or ViT family)", check=_model_name),
    "cache_dir": Option("", (str,), "where 'minilm' is extracted, once for every run; '' = the user cache "
                        "(TRANSFORMER_PDE_CACHE, else ~/.cache/transformer_pde)"),
    "sentences": Option(1000, (int,), "number of sentences drawn from pydoc_data.topics", check=at_least(2)),
    "max_length": Option(64, (int,), "tokens per sentence at most (special tokens included; longer ones are cut)",
                         check=at_least(4)),
    "seed": Option(0, (int,), "seed of the sentence draw and of the power iteration's start"),
    "buckets": Option(4, (int,), "length buckets (sentences sorted by token count; 1 = one batch padded to the "
                      "longest)", check=positive),
    "rungs": Option(list(RUNG_NAMES), (list,), "rungs of the ladder, in ladder order", choices=RUNG_NAMES,
                    check=unique_nonempty),
    "mode": Option("rollout", (str,), "rollout: each rung runs from the real embeddings x_0 through every layer; "
                   "local: each rung maps the real x_l one layer", choices=("rollout", "local")),
    "dt": Option(0.25, (float,), "time step of the continuous rung (1/dt steps per layer)", check=_unit_divisor),
    "radius": Option(1.0, (float,), "chordal radius r of the pair fraction and cluster count (cos > 1 − r²/2)",
                     check=lambda v: None if 0 < v <= 2 else "must lie in (0, 2]"),
    "lipschitz_sentences": Option(8, (int,), "sentences of the Lipschitz estimate (a subset of the selection drawn "
                                  "by a permutation seeded with seed; min(this, sentences) of them)", check=positive),
    "lipschitz_iterations": Option(20, (int,), "power-iteration steps of the Lipschitz estimate, at most",
                                   check=positive),
    "lipschitz_rtol": Option(1e-3, (float,), "the power iteration stops once every estimate σ̂² changes by less "
                             "than this, relative", check=lambda v: None if v > 0 else "must be > 0"),
    "pca_sentence": Option(0, (int,), "index (in the selection) of the sentence drawn as a token cloud",
                           check=lambda v: None if v >= 0 else "must be >= 0"),
    "subsets": Option(True, (bool,), "the order-free ladder: every subset of the four ingredients (feed-forward, "
                      "LayerNorm, biases, discrete time) removed together, rolled out from the embeddings, and each "
                      "ingredient's Shapley share of the gap (post-LN networks)"),
    "bootstrap": Option(1000, (int,), "bootstrap resamples (over sentences) of the Shapley values and shares",
                        check=at_least(100)),
    "reinit_seeds": Option([0, 1, 2], (list,), "seeds of the re-initialised architecture (AutoModel.from_config: "
                           "the configuration's own initialiser) probed side by side with the trained network; [] = "
                           "none", check=lambda v: None if all(isinstance(s, int) and not isinstance(s, bool)
                                                               and s >= 0 for s in v) and len(set(v)) == len(v)
                           else "must be a list of distinct integer seeds >= 0"),
    "figures": Option(True, (bool,), "write the figures"),
    "dtype": Option("float32", (str,), "floating dtype of the network and the probe",
                    choices=("float32", "float64")),
}


def _validate(p):
    available = len(topic_sentences())
    if p["sentences"] > available:
        raise ValueError(f"config key 'sentences' = {p['sentences']}: the help topics of this Python "
                         f"({platform.python_version()}) hold {available} sentences; give sentences <= {available}")
    if p["pca_sentence"] >= p["sentences"]:
        raise ValueError(f"config key 'pca_sentence' = {p['pca_sentence']} must be below sentences = {p['sentences']}")
    if p["buckets"] > p["sentences"]:
        raise ValueError(f"config key 'buckets' = {p['buckets']} exceeds sentences = {p['sentences']}; give "
                         f"buckets <= {p['sentences']}")
    if "network" not in p["rungs"]:
        raise ValueError("config key 'rungs' must include 'network' (the exact map every other rung is compared "
                         "against)")
    if p["model"] != "minilm" and not (Path(p["model"]).expanduser() / "config.json").is_file():
        raise ValueError(f"config key 'model' = {p['model']!r} is neither 'minilm' nor a folder holding a "
                         f"config.json; give 'minilm' or the path of a saved transformers model")
    if p["model"] == "minilm":
        try:
            package_zip()  # installed: refused before the run directory exists, not inside the run
        except ImportError as e:
            raise ValueError(f"config key 'model' = 'minilm': {e}; or give the path of a saved transformers model "
                             f"with -o model=PATH") from None
        positions = _MINILM_POSITIONS
    else:  # the folder's files are checked before the run directory exists (a damaged file: refused, exit 2)
        try:
            positions = check_model_folder(Path(p["model"]).expanduser())["positions"]
        except ValueError as e:
            raise ValueError(f"config key 'model' = {p['model']!r}: {e}") from None
    if positions is not None and p["max_length"] > positions:
        raise ValueError(f"config key 'max_length' = {p['max_length']} is beyond the {positions} positions of the "
                         f"network's position embeddings; give max_length <= {positions}")


def _resources(p):
    item = 4 if p["dtype"] == "float32" else 8
    n, d, L = p["max_length"], 384, 6
    per = p["sentences"] / p["buckets"] * n
    memory = item * per * d * (L + 1) * (len(p["rungs"]) + 3) + item * per * n * 12 * 4
    return {"memory": memory, "steps": L * len(p["rungs"]) * round(1 / p["dt"]),
            "detail": f"{p['sentences']} sentences × ≤ {n} tokens in {p['buckets']} buckets, {len(p['rungs'])} rungs "
                      f"(estimate for a 6-layer, d = 384 network)"}


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` atomically (a temporary file in the same folder, then os.replace)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _folder(p) -> Path:
    """The model folder: a local one, or the packaged network in the shared cache (extracted once)."""
    if p["model"] != "minilm":
        return Path(p["model"]).expanduser()
    return tp.pretrained.packaged_minilm(Path(p["cache_dir"]).expanduser() if p["cache_dir"] else None)


def _stored(run, tag: str, fp: str, weights: str, folder: Path, required):
    """The finished piece ``tag`` of this run (load_segment), refused with the reason when it was computed with
    other weights than the model folder holds now (its files replaced after the run was interrupted)."""
    try:
        return load_segment(run, tag, "pretrained_probe", fp, required=required)
    except ValueError:
        seg = run.load_tensors(tag)
        if isinstance(seg, dict) and seg.get("weights") not in (None, weights):
            raise ValueError(f"{run.data_path(tag)} was computed with other weights than the model folder {folder} "
                             f"holds now (its files changed after the run was interrupted); resuming would average "
                             f"two networks: restore the files, or start afresh with --overwrite or --name NEW") from None
        raise


def _buckets(net, texts: List[str], p) -> List[torch.Tensor]:
    """The selection's indices split into ``buckets`` contiguous groups of the length-sorted order."""
    ids = net.tokenizer(texts, truncation=True, max_length=p["max_length"])["input_ids"]
    lengths = torch.tensor([len(i) for i in ids])
    order = torch.sort(lengths, stable=True).indices
    return [chunk for chunk in torch.tensor_split(order, p["buckets"]) if len(chunk)]


#: padded tokens per chunk of sentences in the distances (the (L+1, chunk, n, n) tensors stay cache-sized)
_CHUNK_TOKENS = 2048


def _chunks(x):
    """Slices of the sentence axis (1) of x (L+1, B, n, d) of about _CHUNK_TOKENS padded tokens."""
    step = max(1, _CHUNK_TOKENS // x.shape[-2])
    return [slice(s, s + step) for s in range(0, x.shape[1], step)]


def _cloud_stats(x, mask, radius):
    """mean cosine, pair fraction, cluster count per (index, sentence) of the normalised tokens."""
    parts = [cloud_statistics(x[:, c], mask[c], radius) for c in _chunks(x)]
    return {k: torch.cat([part[k] for part in parts], -1) for k in parts[0]}


def _w2(pred, real, mask):
    """sentence_w2 per chunk of sentences, (L+1, B)."""
    return torch.cat([sentence_w2(pred[:, c], real[:, c], mask[c]) for c in _chunks(pred)], -1)


def _energies(heads_layers, states, mask):
    """log E of layer l's heads on the normalised tokens of layer l and l + 1, (L, B) each."""
    w = mask.to(states.dtype) / mask.sum(-1, keepdim=True)
    xn = states / states.norm(dim=-1, keepdim=True)
    before = torch.stack([factored_log_energy(xn[l], h, w) for l, h in enumerate(heads_layers)])
    after = torch.stack([factored_log_energy(xn[l + 1], h, w) for l, h in enumerate(heads_layers)])
    return before, after


def _bucket(net, heads_layers, texts, p, pca_at):
    """Everything the probe measures on one bucket of sentences (per-sentence tensors, (…, B))."""
    timing = {}
    t0 = time.perf_counter()
    states, mask = tp.pretrained.hidden_states(net, texts, max_length=p["max_length"])
    timing["hidden_states"] = time.perf_counter() - t0
    out = {"real": _cloud_stats(states, mask, p["radius"]), "tokens": mask.sum(-1),
           "token_norm": ((states.pow(2).sum(-1) * mask).sum(-1) / mask.sum(-1)).sqrt()}
    t0 = time.perf_counter()
    fits = []
    for c in _chunks(states):
        probs, cos = [], []
        for l in range(net.num_layers):
            probs.append(tp.pretrained.attention_probabilities(net, l, states[l, c], mask[c]).mean(1))
            xn = states[l, c] / states[l, c].norm(dim=-1, keepdim=True)
            cos.append(xn @ xn.transpose(-1, -2))
        fits.append(fit_effective_beta(torch.stack(probs), torch.stack(cos), mask[c]))
    out["beta"] = {k: torch.cat([f[k] for f in fits], -1) for k in ("beta", "kl", "kl_uniform")}
    timing["beta"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    energies = [_energies(heads_layers, states[:, c], mask[c]) for c in _chunks(states)]
    out["log_energy"], out["log_energy_next"] = (torch.cat([e[i] for e in energies], -1) for i in (0, 1))
    timing["energy"] = time.perf_counter() - t0
    out["rungs"] = {}
    for rung in p["rungs"]:
        t0 = time.perf_counter()
        pred = tp.pretrained.ladder(net, states, mask, rungs=(rung,), dt=p["dt"], mode=p["mode"])[rung]
        timing[f"ladder_{rung}"] = time.perf_counter() - t0
        bad = ~torch.isfinite(pred)
        if bool(bad.any()):
            layer = int(bad.flatten(1).any(1).nonzero()[0])
            raise FloatingPointError(f"rung {rung!r} produced NaN/inf at hidden-state index {layer} (depth t = "
                                     f"{layer}); lower dt or use float64")
        t0 = time.perf_counter()
        a = pred / pred.norm(dim=-1, keepdim=True)
        b = states / states.norm(dim=-1, keepdim=True)
        angle = torch.acos((a * b).sum(-1).clamp(-1.0, 1.0))  # (L+1, B, n): matched tokens
        out["rungs"][rung] = {**_cloud_stats(pred, mask, p["radius"]), "w2": _w2(pred, states, mask),
                              "mean_angle": (angle * mask).sum(-1) / mask.sum(-1)}
        timing["distances"] = timing.get("distances", 0.0) + time.perf_counter() - t0
        if pca_at is not None:
            out.setdefault("pca", {})[rung] = pred[:, pca_at, : int(mask[pca_at].sum())]
    if p["subsets"]:
        t0 = time.perf_counter()
        out["subsets"] = subset_statistics(net, states, mask, dt=p["dt"], radius=p["radius"],
                                           reuse=out["rungs"] if p["mode"] == "rollout" else None)
        timing["subsets"] = time.perf_counter() - t0
    if pca_at is not None:
        n = int(mask[pca_at].sum())
        out["pca"]["real"] = states[:, pca_at, :n]
        out["pca_tokens"] = net.tokenizer.convert_ids_to_tokens(
            net.tokenizer(texts[pca_at], truncation=True, max_length=p["max_length"])["input_ids"])
    out["timing"] = timing
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in out.items()}


def _layer_map(net, mask):
    """x (L, B, n, d) → (layer_map(net, l, x[l]))_l, the exact blocks (block diagonal over l)."""
    def fn(x):
        return torch.stack([tp.pretrained.layer_map(net, l, x[l], mask) for l in range(x.shape[0])])
    return fn


def _lipschitz_subset(p) -> List[int]:
    """The indices (in the selection, increasing) of the sentences of the Lipschitz estimate: the first
    min(lipschitz_sentences, sentences) of a permutation seeded with ``seed``."""
    count = min(p["lipschitz_sentences"], p["sentences"])
    gen = torch.Generator().manual_seed(p["seed"])
    return sorted(torch.randperm(p["sentences"], generator=gen)[:count].tolist())


def _lipschitz(net, texts, p):
    states, mask = tp.pretrained.hidden_states(net, texts, max_length=p["max_length"])
    gen = torch.Generator().manual_seed(p["seed"])
    x = states[:-1]
    sigma, info = top_singular_value(_layer_map(net, mask), x, batch_dims=2, mask=mask.expand(x.shape[:-1]),
                                     iterations=p["lipschitz_iterations"], generator=gen, rtol=p["lipschitz_rtol"],
                                     full_output=True)
    return {"sigma": sigma.double(), "steps": torch.tensor(info["steps"]),  # sigma: (L, S)
            "converged": info["converged"]}


def _mean_se(v):
    """(mean, se) lists over the last axis of a (K, S) tensor."""
    return v.mean(-1).tolist(), standard_error(v, -1).tolist()


def _merge(parts, key_path):
    """Concatenate the per-sentence tensors at ``key_path`` over the buckets (sentence axis last)."""
    vals = []
    for part in parts:
        node = part
        for k in key_path:
            node = node[k]
        vals.append(node)
    return torch.cat(vals, -1)


@study("pretrained_probe", OPTIONS,
       "real token dynamics of a pretrained transformer on English text: clustering across depth, β_eff, E_β, "
       "Lipschitz constants, and the ladder of mean-field approximations against the network",
       validate=_validate, resources=_resources)
def run_pretrained_probe(params, run):
    """Probe a pretrained network's hidden states against the mean-field picture (module docstring)."""
    p = params
    _validate(p)
    code = code_fingerprint("pretrained_probe")  # the code this run's numbers come from (provenance of the tables)
    dtype = dtype_of(p)
    t_start = time.perf_counter()
    texts = select_sentences(p["sentences"], p["seed"])
    _write_text(run.path / "sentences.txt", "\n".join(texts) + "\n")  # one input per line, as fed to the tokenizer
    folder = _folder(p)
    net = tp.pretrained.load(folder, dtype=dtype)
    if p["subsets"] and net.norm != "post":
        raise ValueError(f"config key 'subsets' = true covers post-LN networks (the BERT family); {p['model']!r} is "
                         f"{net.norm}-LN: run with -o subsets=false")
    # the heads of the continuous rung: biases dropped, ω_h = 1, β = d/√k (tokens of norm √d)
    heads_layers = [tp.pretrained.layer_heads(lw, bias="drop", token_norm=math.sqrt(net.dim)) for lw in net.layers]
    # the stored buckets belong to these texts, parameters and weights (the model folder's files, by content)
    weights = weights_fingerprint(folder)
    fp = fingerprint(p, {"figures", "cache_dir"}, texts=hashlib.sha256("\n".join(texts).encode()).hexdigest(),
                     weights=weights)
    groups = _buckets(net, texts, p)
    parts = []
    with segment_bar(run, len(groups), "pretrained probe", "bucket") as bar:
        for k, idx in enumerate(groups):
            tag = f"bucket_{k}"
            seg = _stored(run, tag, fp, weights, folder, ("real.mean_cosine", "beta.beta"))
            if seg is None:
                sub = [texts[i] for i in idx.tolist()]
                at = (idx == p["pca_sentence"]).nonzero()
                pca_at = int(at[0]) if len(at) else None
                with torch.no_grad():
                    seg = _bucket(net, heads_layers, sub, p, pca_at)
                seg.update({"kind": "transformer_pde.pretrained_probe.segment", "fingerprint": fp, "index": idx,
                            "weights": weights})
                run.save_tensors(tag, seg)
                if run.step_callback is not None:  # monitoring (tests interrupt a run here)
                    run.step_callback(tag, k, float(k))
                log.info("[%s] %d sentences, %s", tag, len(idx),
                         ", ".join(f"{k} {v:.2f} s" for k, v in seg["timing"].items()))
            else:
                log.info("[%s] already complete, reused from data/", tag)
            parts.append(seg)
            bar.update(1)
    lip = _stored(run, "lipschitz", fp, weights, folder, ("sigma", "steps", "converged"))
    if lip is None:
        t0 = time.perf_counter()
        log.info("[lipschitz] power iteration on %d sentences × %d layers (at most %d steps; the longest phase after "
                 "the buckets)", min(p["lipschitz_sentences"], p["sentences"]), net.num_layers,
                 p["lipschitz_iterations"])
        lip = _lipschitz(net, [texts[i] for i in _lipschitz_subset(p)], p)
        log.info("[lipschitz] done in %.1f s (%d steps)", time.perf_counter() - t0, int(lip["steps"]))
        lip.update({"kind": "transformer_pde.pretrained_probe.segment", "fingerprint": fp,
                    "wall": time.perf_counter() - t0, "weights": weights})
        run.save_tensors("lipschitz", lip)
        if run.step_callback is not None:
            run.step_callback("lipschitz", 0, 0.0)
    reinit = []
    for seed in p["reinit_seeds"]:
        tag = f"reinit_{seed}"
        seg = _stored(run, tag, fp, weights, folder, ("mean_cosine", "beta", "lipschitz"))
        if seg is None:
            t0 = time.perf_counter()
            seg = reinit_statistics(reinitialised(net, seed), texts, p, _lipschitz_subset(p))
            log.info("[%s] the architecture re-initialised (seed %d) probed in %.1f s", tag, seed,
                     time.perf_counter() - t0)
            seg.update({"kind": "transformer_pde.pretrained_probe.segment", "fingerprint": fp, "weights": weights})
            run.save_tensors(tag, seg)
        reinit.append({k: seg[k] for k in ("mean_cosine", "clusters", "beta", "lipschitz")})
    metrics = {"code_fingerprint": code, **_metrics(p, net, parts, lip, texts, time.perf_counter() - t_start)}
    if reinit:
        metrics["reinitialised"] = summarise_seeds(reinit, p["reinit_seeds"])
    if p["figures"]:
        pca = next(part for part in parts if "pca" in part)
        figures(run, p, metrics, pca["pca"], pca["pca_tokens"], texts[p["pca_sentence"]])
        if p["subsets"]:
            shapley_figure(run, p, metrics)
        if metrics.get("reinitialised"):
            reinit_figure(run, p, metrics)
    return metrics


def _metrics(p, net, parts, lip, texts, wall):
    L = net.num_layers
    real = {}
    for s in _STATS:
        real[s], real[f"{s}_se"] = _mean_se(_merge(parts, ("real", s)))
    real["token_norm"], real["token_norm_se"] = _mean_se(_merge(parts, ("token_norm",)))
    beta = _merge(parts, ("beta", "beta"))
    le, le_next = _merge(parts, ("log_energy",)), _merge(parts, ("log_energy_next",))
    sigma = lip["sigma"]
    layers = {"beta_eff": beta.mean(-1).tolist(), "beta_eff_se": standard_error(beta, -1).tolist(),
              "beta_eff_median": beta.median(-1).values.tolist(),
              "kl_fit": _merge(parts, ("beta", "kl")).mean(-1).tolist(),
              "kl_uniform": _merge(parts, ("beta", "kl_uniform")).mean(-1).tolist(),
              "log_energy": le.mean(-1).tolist(), "log_energy_se": standard_error(le, -1).tolist(),
              "log_energy_change": (le_next - le).mean(-1).tolist(),
              "log_energy_change_se": standard_error(le_next - le, -1).tolist(),
              "energy_increase_fraction": (le_next > le).double().mean(-1).tolist(),
              "lipschitz": sigma.mean(-1).tolist(), "lipschitz_se": standard_error(sigma, -1).tolist(),
              "lipschitz_max": sigma.amax(-1).tolist(), "lipschitz_sentences": int(sigma.shape[-1]),
              "lipschitz_steps": int(lip["steps"]),
              "lipschitz_unconverged": int((~lip["converged"]).sum())}
    ladder = {}
    for rung in p["rungs"]:
        entry = {}
        for s in ("w2", "mean_angle") + _STATS:
            entry[s], entry[f"{s}_se"] = _mean_se(_merge(parts, ("rungs", rung, s)))
        ladder[rung] = entry
    timing = {}
    for part in parts:
        for k, v in part["timing"].items():
            timing[k] = timing.get(k, 0.0) + v
    timing["lipschitz"] = float(lip["wall"])
    last = ladder[p["rungs"][0]]["w2"][-1]
    steps = []
    for prev, rung in zip(p["rungs"], p["rungs"][1:]):  # paired over sentences: the change one ingredient makes
        diff = _merge(parts, ("rungs", rung, "w2"))[-1] - _merge(parts, ("rungs", prev, "w2"))[-1]
        steps.append({"from": prev, "to": rung, "w2_final_change": float(diff.mean()),
                      "w2_final_change_se": float(standard_error(diff))})
    summary = [f"{len(texts)} sentences, {int(_merge(parts, ('tokens',)).sum())} tokens; mean cosine of the real "
               f"tokens {real['mean_cosine'][0]:.3f} ± {real['mean_cosine_se'][0]:.3f} (embeddings) → "
               f"{real['mean_cosine'][-1]:.3f} ± {real['mean_cosine_se'][-1]:.3f} (layer {L}), ± one standard "
               f"error over sentences",
               f"W2 to the real final tokens ({p['mode']}): " + ", ".join(
                   f"{r} {ladder[r]['w2'][-1]:.3g}" for r in p["rungs"]) + f" (network map: {last:.2g})"]
    subsets = None
    if p["subsets"]:
        names = parts[0]["subsets"].keys()
        subsets = shapley_summary({n: {k: _merge(parts, ("subsets", n, k)) for k in SUBSET_METRICS} for n in names},
                                  seed=p["seed"], resamples=p["bootstrap"])
    return {"subsets": subsets, "model": {"source": p["model"], "family": net.family, "norm": net.norm, "causal": bool(net.causal),
                      "layers": L, "dim": net.dim, "heads": net.num_heads, "head_dim": net.head_dim},
            "text": {"source": "pydoc_data.topics", "python": platform.python_version(), "sentences": len(texts),
                     "sha256": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
                     "tokens": int(_merge(parts, ("tokens",)).sum()), "buckets": len(parts)},
            "error_bars": "± one standard error over sentences (s/√S); the Lipschitz constants over the "
                          f"{int(sigma.shape[-1])} sentences of their estimate",
            "clustering_radius": p["radius"], "real": real, "layers": layers, "ladder": ladder,
            "ladder_rungs": list(p["rungs"]),
            "ladder_mode": p["mode"], "ladder_steps": steps, "timing": timing, "probe_wall_s": wall,
            "summary": summary}
