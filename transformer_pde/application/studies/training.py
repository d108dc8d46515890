"""Training study: a continuous-depth attention classifier on scikit-learn's handwritten digits.

The 1797 8×8 images of ``sklearn.datasets.load_digits`` (shipped with scikit-learn, no download)
are split once (stratified, ``split_seed``) into a training and a test set.  Each image becomes
n tokens (its 8 rows, or its 16 patches of 2×2 pixels), embedded by a linear map plus a learned
position vector.  Three kinds of classifier share that embedding and a linear read-out of the
mean-pooled tokens:

* "flow": the tokens are normalised onto the unit sphere and carried through depth T by
  :class:`transformer_pde.nn.MeanFieldAttention` (L layers of H heads, the feed-forward term
  between layers, fixed-step solver);
* "transformer": a discrete ``torch.nn.TransformerEncoder`` (post-LN, GELU, no dropout) with the
  same d, H and L, its feed-forward width chosen so that its parameter count is the closest to
  the flow's (both counts are reported);
* "flow_kinetic_<λ>": the flow trained with the loss + λ·(kinetic term): with ``kinetic = "metric"``
  ∫_0^T 𝒢² dt, the solver's own ledger term (``MeanFieldAttention(..., kinetic=True)``), the
  transport cost in the model's mobility metric; with ``kinetic = "displacement"`` the action
  Σ_k Σ_i |x_{k+1,i} − x_{k,i}|²/(nΔt) of the solver's steps → ∫∫|v|² dμ dt, OT-Transformer's
  λ∫‖v‖² dt.

Every model is trained from every seed with the same budget: the same epochs, batch size,
optimiser (Adam) and learning rate; a seed fixes the initialisation and the batch order, and the
flows at every λ start from the same initialisation as the plain flow of that seed (paired).
Per epoch: training loss (and kinetic term), test loss and accuracy; checkpoints after every
epoch (atomic), and ``--resume`` continues from the last finished epoch.

Then, for the trained flows, the depth statistics on ``analysis_images`` test images: the mean
cosine Σ_{i≠j}⟨x_i, x_j⟩/(n(n−1)) and the single-linkage cluster count at chordal radius
``radius`` (:func:`transformer_pde.clustering.cluster_statistics`), the energy E and 𝒢² along
depth — and how they move with λ.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time

import torch

import transformer_pde as tp

from ...utils import threads
from .provenance import code_fingerprint
from . import (Option, at_least, nonnegative, panel, positive, save_captioned, segment_bar, study, subplots,
               unique_nonempty)

log = logging.getLogger(__name__)
_KIND = "transformer_pde.train_digits.segment"  # the stored pieces (finite, checked on resume)

__all__ = ["results_table", "DigitClassifier", "load_digit_tokens"]

def _seeds(v):
    if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32 for s in v):
        return "must be a list of integer seeds in [0, 2³² − 1]"
    return unique_nonempty(v)


def _lambdas(v):
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v):
        return "must be a list of numbers λ > 0 (the flow at λ = 0 is always trained), e.g. [0.001, 0.01]"
    return None if len(set(v)) == len(v) else "must not repeat a value"


OPTIONS = {
    "seeds": Option([0, 1, 2, 3, 4], (list,), "seeds of the ensemble (initialisation and batch order)",
                    check=lambda v: _seeds(v)),
    "epochs": Option(20, (int,), "training epochs of every model", check=positive),
    "batch_size": Option(64, (int,), "minibatch size", check=positive),
    "lr": Option(5e-3, (float,), "Adam learning rate", check=positive),
    "dim": Option(32, (int,), "token dimension d", check=at_least(2)),
    "heads": Option(4, (int,), "attention heads H (d must be a multiple of H)", check=positive),
    "layers": Option(2, (int,), "layers L (the flow's parameter slices on [0, T])", check=positive),
    "feedforward": Option(64, (int,), "feed-forward width m of the flow (0: attention only)", check=nonnegative),
    "depth": Option(1.0, (float,), "depth T of the flow", check=positive),
    "steps": Option(4, (int,), "solver steps per layer of the flow", check=positive),
    "method": Option("euler", (str,), "fixed-step method of the flow (MeanFieldAttention's method=)",
                     choices=("euler", "heun", "rk4")),
    "layer_norm": Option("none", (str,), "the flow's layer norm: the projected flow, or the post-LN map",
                         choices=("none", "post")),
    "lambdas": Option([1e-4, 1e-3, 1e-2], (list,), "weights λ of the kinetic regulariser λ∫𝒢²dt (one flow each)",
                      check=lambda v: _lambdas(v)),
    "kinetic": Option("metric", (str,), "the regulariser's kinetic term: ∫𝒢²dt from the solver's ledger (metric) "
                      "or the action Σ|x_{k+1} − x_k|²/Δt of its steps (displacement)",
                      choices=("metric", "displacement")),
    "tokens": Option("rows", (str,), "tokens of an image: its 8 rows or its 16 patches of 2×2",
                     choices=("rows", "patches")),
    "test_fraction": Option(0.3, (float,), "share of the images held out for testing",
                            check=lambda v: None if 0 < v < 1 else "must lie strictly between 0 and 1"),
    "split_seed": Option(0, (int,), "seed of the stratified train/test split"),
    "train_limit": Option(0, (int,), "train on the first k training images only (0: all of them)",
                          check=nonnegative),
    "analysis_images": Option(256, (int,), "test images of the depth statistics", check=positive),
    "radius": Option(0.5, (float,), "chordal radius of the cluster counts", check=positive),
    "figures": Option(True, (bool,), "write the figures"),
    "dtype": Option("float32", (str,), "floating dtype", choices=("float32", "float64")),
}


_IMAGES, _CLASSES = 1797, 10  # scikit-learn's digits


def _validate(p):
    if p["dim"] % p["heads"]:
        raise ValueError(f"config keys 'dim' = {p['dim']} and 'heads' = {p['heads']}: d must be a multiple of H")
    n_test = math.ceil(p["test_fraction"] * _IMAGES)  # scikit-learn's rule for a fractional test_size
    n_train = _IMAGES - n_test
    if min(n_train, n_test) < _CLASSES:
        raise ValueError(f"config key 'test_fraction' = {p['test_fraction']:g} leaves {n_train} training and {n_test} "
                         f"test images of {_IMAGES}; the stratified split needs at least one image of each of the "
                         f"{_CLASSES} digits on both sides: take test_fraction in "
                         f"[{_CLASSES / _IMAGES:.3f}, {1 - _CLASSES / _IMAGES:.3f}] (e.g. 0.3)")
    if p["analysis_images"] > n_test:
        raise ValueError(f"config key 'analysis_images' = {p['analysis_images']} is more than the {n_test} test images "
                         f"of test_fraction = {p['test_fraction']:g}; give analysis_images <= {n_test}")
    if importlib.util.find_spec("sklearn") is None:
        raise ValueError("the train_digits study reads scikit-learn's load_digits: install scikit-learn "
                         "(pip install 'transformer_pde[train]' or pip install scikit-learn)")


def _resources(p):
    n_train = round(1797 * (1 - p["test_fraction"]))
    steps = math.ceil(n_train / p["batch_size"]) * p["epochs"] * len(p["seeds"]) * (2 + len(p["lambdas"]))
    item = 4 if p["dtype"] == "float32" else 8
    n = 8 if p["tokens"] == "rows" else 16
    memory = item * 1797 * 64 * 2 + item * 40.0 * p["batch_size"] * n * p["dim"] * p["layers"] * p["steps"]
    return {"memory": memory, "steps": steps * p["layers"] * p["steps"],
            "detail": f"{steps} optimiser steps of {p['layers'] * p['steps']} solver steps"}


# ---------------------------------------------------------------------------- data and models
def load_digit_tokens(tokens: str = "rows", *, test_fraction: float = 0.3, split_seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> dict:
    """The digits as token sets: "train"/"test" tensors (N, n, p) with pixels scaled to [0, 1] and labels (N,).

    Parameters
    ----------
    tokens : str
        "rows" (n = 8 tokens of p = 8 pixels) or "patches" (n = 16 patches of p = 4 pixels).
    test_fraction : float
        share of the images in the stratified test set.
    split_seed : int
        seed of the split.
    dtype : torch.dtype
        of the pixel tensors.

    Returns
    -------
    dict
        "x_train", "y_train", "x_test", "y_test".
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    img = torch.as_tensor(data.images, dtype=dtype) / 16.0  # (N, 8, 8)
    if tokens == "patches":
        img = img.reshape(-1, 4, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(-1, 16, 4)
    y = torch.as_tensor(data.target, dtype=torch.long)
    idx = torch.arange(len(y))
    tr, te = train_test_split(idx.numpy(), test_size=test_fraction, random_state=split_seed, stratify=y.numpy())
    tr, te = torch.as_tensor(tr), torch.as_tensor(te)
    return {"x_train": img[tr], "y_train": y[tr], "x_test": img[te], "y_test": y[te]}


class DigitClassifier(torch.nn.Module):
    """Embedding (linear + position) → body → mean pooling → linear read-out to 10 classes.

    ``body`` is a :class:`~transformer_pde.nn.MeanFieldAttention` (the tokens are first normalised
    onto the sphere) or a ``torch.nn.TransformerEncoder`` (batch_first)."""

    def __init__(self, body: torch.nn.Module, *, tokens: int, pixels: int, dim: int, classes: int = 10):
        super().__init__()
        self.embed = torch.nn.Linear(pixels, dim)
        self.position = torch.nn.Parameter(0.1 * torch.randn(tokens, dim))
        self.body = body
        self.readout = torch.nn.Linear(dim, classes)
        self.flow = isinstance(body, tp.nn.MeanFieldAttention)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The embedded tokens (B, n, d), on the unit sphere for a flow."""
        z = self.embed(images) + self.position
        if not self.flow:
            return z
        r = z.norm(dim=-1, keepdim=True)
        if not bool((torch.isfinite(r) & (r > 0)).all()):  # the flow needs a direction for every token
            raise FloatingPointError(f"the embedded tokens have norm {float(r.max()):.3g} (max) / {float(r.min()):.3g} "
                                     f"(min): the embedding's weights overflowed or vanished (a learning rate too "
                                     f"large?); tokens without a finite direction cannot be put on the sphere")
        return z / r

    def forward(self, images: torch.Tensor, *, kinetic=False):
        """Logits (B, 10), and with ``kinetic`` (flows only: True, "metric" or "displacement") the kinetic
        term (B,) of :class:`~transformer_pde.nn.MeanFieldAttention`."""
        z = self.tokens(images)
        kin = None
        if self.flow:
            out = self.body(z, kinetic=kinetic)
            z, kin = out if kinetic else (out, None)
        else:
            z = self.body(z)
        logits = self.readout(z.mean(-2))
        return (logits, kin) if kinetic else logits


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _flow_body(p, dtype):
    return tp.nn.MeanFieldAttention(p["dim"], p["heads"], layers=p["layers"], t1=p["depth"], steps=p["steps"],
                                    method=p["method"], layer_norm=p["layer_norm"], feedforward=p["feedforward"],
                                    dtype=dtype)


def _encoder(p, width, dtype):
    layer = torch.nn.TransformerEncoderLayer(p["dim"], p["heads"], width, dropout=0.0, activation="gelu",
                                             batch_first=True, dtype=dtype)
    return torch.nn.TransformerEncoder(layer, p["layers"], enable_nested_tensor=False)


def _matched_width(p, target: int, dtype, n: int, pixels: int) -> int:
    """The encoder's feed-forward width whose classifier has the parameter count closest to ``target``."""
    def count(m):
        return _count(DigitClassifier(_encoder(p, m, dtype), tokens=n, pixels=pixels, dim=p["dim"]))

    base, per = count(1), count(2) - count(1)  # the count is affine in the width
    return max(1, round((target - base) / per) + 1)


def _build(p, name, seed, dtype, shape):
    n, pixels = shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "transformer":
            flow_count = _count(DigitClassifier(_flow_body(p, dtype), tokens=n, pixels=pixels, dim=p["dim"]))
            body = _encoder(p, _matched_width(p, flow_count, dtype, n, pixels), dtype)
        else:
            body = _flow_body(p, dtype)
        return DigitClassifier(body, tokens=n, pixels=pixels, dim=p["dim"]).to(dtype)


def _model_names(p):
    return ["flow", "transformer"] + [f"flow_kinetic_{lam:g}" for lam in p["lambdas"]]


def _lambda(name: str) -> float:
    return float(name.rsplit("_", 1)[1]) if name.startswith("flow_kinetic_") else 0.0


# ---------------------------------------------------------------------------- training with checkpoints
def _evaluate(model, x, y, batch: int = 512):
    """(test loss, accuracy, mean ∫𝒢²dt, mean action; None for a discrete model) without gradients."""
    loss, correct, kin, act = 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(y), batch):
            xb, yb = x[i:i + batch], y[i:i + batch]
            if model.flow:
                logits, k = model(xb, kinetic="metric")
                kin += float(k.sum())
                act += float(model(xb, kinetic="displacement")[1].sum())
            else:
                logits = model(xb)
            loss += float(torch.nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(-1) == yb).sum())
    if not model.flow:
        return loss / len(y), correct / len(y), None, None
    return loss / len(y), correct / len(y), kin / len(y), act / len(y)


def train_model(p, name: str, seed: int, data: dict, run) -> dict:
    """Train one model from one seed, epoch by epoch, checkpointing after every epoch (data/<tag>_checkpoint.pt,
    atomic; the run directory's resume checks refuse a damaged or non-finite one); the finished result is
    stored under data/<tag>.pt and reused on resume.  Returns {"records", "parameters", "state"}."""
    tag = f"{name}_seed{seed}"
    if run.resume:
        done = run.load_tensors(tag)
        if done is not None:
            return done
    dtype = data["x_train"].dtype
    model = _build(p, name, seed, dtype, tuple(data["x_train"].shape[1:]))
    opt = torch.optim.Adam(model.parameters(), lr=p["lr"])
    gen = torch.Generator().manual_seed(seed)
    records, start = [], 0
    ckpt = f"{tag}_checkpoint"
    st = run.load_tensors(ckpt) if run.resume else None
    if st is not None:
        try:
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optimizer"])
            gen.set_state(st["generator"])
            records, start = st["records"], int(st["epoch"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{run.data_path(ckpt)} does not fit this run's {name} model ({type(e).__name__}: "
                             f"{str(e)[:200]}); it is not this run's checkpoint: delete it to train that model "
                             f"afresh") from None
        log.info("[%s] resumed after epoch %d", tag, start)
    lam, x, y = _lambda(name), data["x_train"], data["y_train"]
    # the thread policy (the CLI's --threads, "auto" by default) for the whole step, backward included: these
    # small kernels run fastest on one thread, and two threads on a busy machine can be several times slower
    work = p["batch_size"] * p["heads"] * x.shape[1] ** 2 * p["dim"]
    with threads.scope(work) as pool:
        try:
            records = _epochs(p, model, opt, gen, records, start, data, run, tag, lam, pool)
        except FloatingPointError as e:  # from inside a forward pass: say which model and learning rate
            if str(e).startswith(tag):
                raise
            raise FloatingPointError(f"{tag}, training with lr = {p['lr']:g}: {e}") from None
    out = {"kind": _KIND, "records": records, "parameters": _count(model), "state": model.state_dict()}
    run.save_tensors(tag, out)
    run.data_path(ckpt).unlink(missing_ok=True)
    return out


def _epochs(p, model, opt, gen, records, start, data, run, tag, lam, pool):
    """The epochs start+1 … epochs of one model: batches, test evaluation, per-epoch record and checkpoint."""
    x, y, ckpt = data["x_train"], data["y_train"], f"{tag}_checkpoint"
    for epoch in range(start, p["epochs"]):
        t0 = time.perf_counter()
        perm = torch.randperm(len(y), generator=gen)
        tot, kin_tot = 0.0, 0.0
        for i in range(0, len(y), p["batch_size"]):
            b = perm[i:i + p["batch_size"]]
            try:
                if lam > 0:
                    logits, kin = model(x[b], kinetic=p["kinetic"])
                    loss = torch.nn.functional.cross_entropy(logits, y[b])
                    total = loss + lam * kin.mean()
                    kin_tot += float(kin.detach().sum())
                else:
                    logits = model(x[b])
                    total = loss = torch.nn.functional.cross_entropy(logits, y[b])
            except ValueError as e:
                if epoch == 0 and i == 0:  # the initial weights: not a divergence
                    raise
                raise _diverged(model, f"{tag}: the forward pass at epoch {epoch + 1}, batch {i // p['batch_size']}",
                                p["lr"], e) from None
            if not torch.isfinite(total):
                raise FloatingPointError(f"{tag}: the training loss is {float(total)} at epoch {epoch + 1}, batch "
                                         f"{i // p['batch_size']}; lower lr (now {p['lr']}) or depth/β")
            opt.zero_grad()
            total.backward()
            opt.step()
            _check_parameters(model, tag, epoch, i // p["batch_size"], p["lr"])
            pool.refresh()
            tot += float(loss.detach()) * len(b)
        try:
            test_loss, test_acc, test_kin, test_act = _evaluate(model, data["x_test"], data["y_test"])
        except ValueError as e:
            raise _diverged(model, f"{tag}: the test evaluation after epoch {epoch + 1}", p["lr"], e) from None
        rec = {"epoch": epoch + 1, "train_loss": tot / len(y), "test_loss": test_loss, "test_accuracy": test_acc,
               "seconds": time.perf_counter() - t0}
        if lam > 0:
            rec["train_kinetic"] = kin_tot / len(y)
        if test_kin is not None:
            rec["test_kinetic"], rec["test_action"] = test_kin, test_act
        records.append(rec)
        run.save_tensors(ckpt, {"kind": _KIND, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                "generator": gen.get_state(), "records": records, "epoch": epoch + 1})
        report = getattr(run, "step_callback", None)
        if report is not None:
            report(tag, epoch + 1, float(epoch + 1))
    return records


def _diverged(model, where: str, lr: float, error: Exception) -> FloatingPointError:
    """The error of a forward pass that worked with the initial weights and fails after optimiser steps: the
    steps moved the weights out of the range the model computes in (a divergence: exit code 3, not a bad input)."""
    big, name = max((float(v.detach().abs().max()), n) for n, v in model.named_parameters())
    return FloatingPointError(f"{where} failed after the optimiser steps with lr = {lr:g} moved the weights to "
                              f"|{name}| = {big:.3g} (the training diverged; lower lr): {error}")


def _check_parameters(model, tag: str, epoch: int, batch: int, lr: float) -> None:
    """FloatingPointError (the run produced NaN/inf) naming the first parameter an optimiser step left non-finite:
    caught here, the next forward pass would fail on its non-finite tokens with a message about its input."""
    for pname, v in model.named_parameters():
        if not bool(torch.isfinite(v).all()):
            raise FloatingPointError(f"{tag}: the optimiser step at epoch {epoch + 1}, batch {batch} left the "
                                     f"parameter {pname} NaN/inf (learning rate lr = {lr:g}); lower lr")


# ---------------------------------------------------------------------------- depth statistics
def _depth_statistics(p, name, seed, state, data) -> dict:
    """Mean cosine, cluster count, energy and 𝒢² along depth, averaged over the analysis images (T,) each."""
    x = data["x_test"][:p["analysis_images"]]
    model = _build(p, name, seed, x.dtype, tuple(x.shape[1:]))
    model.load_state_dict(state)
    with torch.no_grad():
        tr = model.body.trajectory(model.tokens(x))
        st = tp.clustering.cluster_statistics(tr["x"], radius=p["radius"], gram_rank=False)
    return {"times": tr["times"], "mean_cosine": st["mean_overlap"].mean(-1),
            "clusters": st["clusters"].to(x.dtype).mean(-1), "energy": tr["energy"].mean(-1),
            "slope": tr["slope"].mean(-1), "kinetic": tr["kinetic"].mean()}


def _summary(values) -> dict:
    v = torch.tensor([float(a) for a in values], dtype=torch.float64)
    sem = float(v.std(unbiased=True) / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return {"mean": float(v.mean()), "sem": sem, "seeds": [float(a) for a in values]}


@study("train_digits", OPTIONS, "continuous-depth attention vs a discrete transformer on scikit-learn's digits, "
       "with the kinetic regulariser λ∫𝒢²dt", validate=_validate, resources=_resources)
def train_digits(p, run):
    """Train the flow, the discrete transformer and the flows at each λ from every seed (module docstring)."""
    code = code_fingerprint("train_digits")  # the code this run's numbers come from (provenance of the tables)
    dtype = {"float32": torch.float32, "float64": torch.float64}[p["dtype"]]
    data = load_digit_tokens(p["tokens"], test_fraction=p["test_fraction"], split_seed=p["split_seed"], dtype=dtype)
    if p["train_limit"]:
        data["x_train"], data["y_train"] = data["x_train"][:p["train_limit"]], data["y_train"][:p["train_limit"]]
    names, seeds = _model_names(p), p["seeds"]
    results = {}
    with segment_bar(run, len(names) * len(seeds), "train_digits", "model") as bar:
        for seed in seeds:
            for name in names:
                results[name, seed] = train_model(p, name, seed, data, run)
                bar.update(1)
    metrics = {"test_accuracy": {}, "test_loss": {}, "parameters": {}, "seconds_per_epoch": {}, "test_kinetic": {},
               "history": {}, "split": {"train": len(data["y_train"]), "test": len(data["y_test"])},
               "kinetic": p["kinetic"], "code_fingerprint": code}
    for name in names:
        recs = [results[name, s]["records"] for s in seeds]
        metrics["test_accuracy"][name] = _summary([r[-1]["test_accuracy"] for r in recs])
        metrics["test_loss"][name] = _summary([r[-1]["test_loss"] for r in recs])
        metrics["parameters"][name] = results[name, seeds[0]]["parameters"]
        metrics["seconds_per_epoch"][name] = _summary([sum(e["seconds"] for e in r) / len(r) for r in recs])
        if name != "transformer":
            metrics["test_kinetic"][name] = _summary([r[-1]["test_kinetic"] for r in recs])
            if all("test_action" in r[-1] for r in recs):
                metrics.setdefault("test_action", {})[name] = _summary([r[-1]["test_action"] for r in recs])
        metrics["history"][name] = {str(s): r for s, r in zip(seeds, recs)}
        for s, r in zip(seeds, recs):
            run.save_series(f"{name}_seed{s}", {k: [e.get(k, float("nan")) for e in r] for k in r[-1]})
    flows = [n for n in names if n != "transformer"]
    depth = {n: [_depth_statistics(p, n, s, results[n, s]["state"], data) for s in seeds] for n in flows}
    metrics["depth"] = {n: {"times": depth[n][0]["times"].tolist(),
                            **{k: torch.stack([d[k] for d in depth[n]]).mean(0).tolist()
                               for k in ("mean_cosine", "clusters", "energy", "slope")},
                            "final_mean_cosine": _summary([d["mean_cosine"][-1] for d in depth[n]]),
                            "final_clusters": _summary([d["clusters"][-1] for d in depth[n]]),
                            "energy_change": _summary([d["energy"][-1] - d["energy"][0] for d in depth[n]])}
                        for n in flows}
    metrics["kinetic_tradeoff"] = _tradeoff(metrics, p, seeds)
    metrics["summary"] = _headline(metrics, len(seeds))
    if p["figures"]:
        _figures(run, metrics, p)
    return metrics


def _headline(m, seeds: int) -> list:
    """The lines the command line prints at the end: test accuracy and ∫𝒢²dt per model, ± standard error."""
    def pm(s, fmt=".3f", err=".3f"):
        sem = s["sem"]
        return f"{s['mean']:{fmt}}" + (f" ± {sem:{err}}" if sem == sem else "")  # no ± for one seed

    return [f"test accuracy, mean ± standard error over {seeds} seed(s): "
            + ", ".join(f"{name} {pm(v)}" for name, v in m["test_accuracy"].items()),
            "∫𝒢²dt on the test images: " + ", ".join(f"{name} {pm(v, '.3g', '.2g')}"
                                                      for name, v in m["test_kinetic"].items())]


def _tradeoff(m, p, seeds) -> dict:
    """Paired (same seed) differences flow_kinetic_λ − flow of test loss and accuracy, and transformer − flow."""
    out = {}
    base_acc, base_loss = m["test_accuracy"]["flow"]["seeds"], m["test_loss"]["flow"]["seeds"]
    for name in [f"flow_kinetic_{lam:g}" for lam in p["lambdas"]] + ["transformer"]:
        acc, loss = m["test_accuracy"][name]["seeds"], m["test_loss"][name]["seeds"]
        out[name] = {"accuracy_minus_flow": _summary([a - b for a, b in zip(acc, base_acc)]),
                     "loss_minus_flow": _summary([a - b for a, b in zip(loss, base_loss)])}
    return out


def _figures(run, m, p):
    names = list(m["test_accuracy"])
    fig, axes = subplots(1, 2, figsize=(11, 4))
    for name in names:
        hist = m["history"][name]
        acc = torch.tensor([[e["test_accuracy"] for e in r] for r in hist.values()]).mean(0)
        axes[0].plot(range(1, len(acc) + 1), acc, marker=".", label=name)
    panel(axes[0], "epoch", "test accuracy", "learning curves (mean over seeds)", legend=True)
    lams = [0.0] + list(p["lambdas"])
    flows = ["flow"] + [f"flow_kinetic_{lam:g}" for lam in p["lambdas"]]
    xs = [max(lam, min([l for l in p["lambdas"] if l > 0] or [1.0]) / 10) for lam in lams]
    acc = [m["test_accuracy"][n]["mean"] for n in flows]
    err = [m["test_accuracy"][n]["sem"] for n in flows]
    axes[1].errorbar(xs, acc, yerr=err, marker="o", color="C0", label="test accuracy")
    t = m["test_accuracy"]["transformer"]
    axes[1].axhline(t["mean"], color="C1", ls="--", label="discrete transformer")
    axes[1].set_xscale("log")
    twin = axes[1].twinx()
    twin.plot(xs, [m["test_kinetic"][n]["mean"] for n in flows], marker="s", color="C3", label="∫G² dt (test)")
    twin.set_yscale("log")
    twin.set_ylabel("∫G² dt")
    panel(axes[1], "λ (leftmost point: λ = 0)", "test accuracy", "the kinetic regulariser")
    handles = axes[1].get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    axes[1].legend(handles[0] + more[0], handles[1] + more[1])
    save_captioned(run, fig, "train_digits_accuracy",
                   f"Digits, {len(p['seeds'])} seeds, {p['epochs']} epochs: test accuracy per epoch, and at the end "
                   f"against λ (error bars: standard error over seeds) with the flow's ∫G²dt.", m, tidy=True)
    fig, axes = subplots(1, 4, figsize=(16, 3.6))
    keys = (("mean_cosine", "mean cosine"), ("clusters", f"clusters (r = {p['radius']:g})"), ("energy", "energy E"),
            ("slope", "G² (metric slope)"))
    for name in flows:
        d = m["depth"][name]
        for ax, (k, _) in zip(axes, keys):
            ax.plot(d["times"], d[k], label=name)
    for ax, (k, label) in zip(axes, keys):
        panel(ax, "depth t", label, label, legend=(k == "mean_cosine"))
        if k in ("energy", "slope"):  # they span decades between the models
            ax.set_yscale("log")
    save_captioned(run, fig, "train_digits_depth",
                   f"Trained flows along depth, mean over {p['analysis_images']} test images and {len(p['seeds'])} "
                   f"seeds: mean token cosine, cluster count, energy and G² for each λ (a layer boundary, where the heads "
                   f"jump and the feed-forward step acts, is recorded twice).", m, tidy=True)


# ---------------------------------------------------------------------------- the docs table
def results_table(metrics: dict) -> str:
    """A markdown table of a ``train_digits`` metrics.json: per model its parameters, test accuracy and loss
    (mean ± standard error over seeds), the flows' kinetic terms, final mean cosine, cluster count and energy
    change along depth (on the analysis images).

    Parameters
    ----------
    metrics : dict
        the parsed metrics.json of a train_digits run.

    Returns
    -------
    str
        the table, one model per row."""
    def pm(s, scale=1.0, digits=3):
        sem = s["sem"]
        if sem is None or sem != sem:
            return f"{s['mean'] * scale:.{digits}f}"
        return f"{s['mean'] * scale:.{digits}f} ± {sem * scale:.{digits}f}"

    def pg(s):  # quantities spanning decades: significant digits
        sem = s["sem"]
        return f"{s['mean']:.3g}" if sem is None or sem != sem else f"{s['mean']:.3g} ± {sem:.2g}"

    rows = ["| model | parameters | test accuracy (%) | test loss | ∫𝒢²dt (test) | action Σ‖Δx‖²/Δt (test) "
            "| final mean cosine | final clusters | E(T) − E(0) | seconds / epoch |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, acc in metrics["test_accuracy"].items():
        d = metrics.get("depth", {}).get(name)
        kin = metrics["test_kinetic"].get(name)
        act = metrics.get("test_action", {}).get(name)
        rows.append(f"| {name} | {metrics['parameters'][name]} | {pm(acc, 100, 2)} | {pm(metrics['test_loss'][name])} | "
                    f"{pg(kin) if kin else '—'} | {pg(act) if act else '—'} | "
                    f"{pm(d['final_mean_cosine']) if d else '—'} | "
                    f"{pm(d['final_clusters'], digits=2) if d else '—'} | {pg(d['energy_change']) if d else '—'} | "
                    f"{pm(metrics['seconds_per_epoch'][name], digits=2)} |")
    n = len(next(iter(metrics["test_accuracy"].values()))["seeds"])
    kind = metrics.get("kinetic", "metric")
    return "\n".join(rows) + (f"\n\nmean ± standard error over {n} seeds; flow_kinetic_λ trained with λ × "
                               f"{'∫𝒢²dt' if kind == 'metric' else 'the action Σ‖Δx‖²/Δt'}.")


def tradeoff_table(metrics: dict) -> str:
    """A markdown table of the paired (same seed) differences model − flow of a ``train_digits`` metrics.json:
    test accuracy (percentage points) and test loss, mean ± standard error over seeds, with the seeds on which
    the model's test loss is lower than the flow's.

    Parameters
    ----------
    metrics : dict
        the parsed metrics.json of a train_digits run.

    Returns
    -------
    str
        the table, one compared model per row."""
    rows = ["| model − flow (paired by seed) | Δ test accuracy (points) | Δ test loss | seeds with lower test loss |",
            "|---|---|---|---|"]
    for name, d in metrics["kinetic_tradeoff"].items():
        acc, loss = d["accuracy_minus_flow"], d["loss_minus_flow"]
        lower = sum(v < 0 for v in loss["seeds"])
        rows.append(f"| {name} | {100 * acc['mean']:+.2f} ± {100 * acc['sem']:.2f} | {loss['mean']:+.4f} ± "
                    f"{loss['sem']:.4f} | {lower} of {len(loss['seeds'])} |")
    return "\n".join(rows)
