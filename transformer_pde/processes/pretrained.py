"""Real pretrained transformers (BERT family, GPT-2, ViT) read as the layerwise parameter measure Θ_t.

Mapping (docs/pretrained.md).  Layer l of a network with H heads of width k = d/H holds, per head,
the query, key, value rows W_{Q,h}, W_{K,h}, W_{V,h} (k×d) with biases b_{Q,h}, b_{K,h}, b_{V,h}
(k) and the output columns W_{O,h} (d×k) with the shared output bias b_O (d).  Its attention
sublayer is, on the tokens z_i it reads,

    MHA(z)_i = Σ_h W_{O,h} Σ_j p^h_ij (W_{V,h} z_j + b_{V,h}) + b_O,
    p^h_ij ∝ w_j exp(c ⟨W_{Q,h} z_i + b_{Q,h}, W_{K,h} z_j + b_{K,h}⟩),   c = 1/√k

(w_j: the padding mask; c as the network scales, GPT-2 may also divide by the layer index).
Without biases this is Σ_h V_h ȳ_h with score A_h = c W_{Q,h}ᵀ W_{K,h} and value
V_h = W_{O,h} W_{V,h}, both of rank k ≪ d: the heads keep the factors (query/key and
value_in/value_out of :class:`~transformer_pde.Heads`), no d×d matrix is formed.  On tokens of
norm r (z = r x, x on the unit sphere) the heads are β = r² c, the same factors, and the
update MHA(r x)/r of the unit token (``token_norm=r``; None means r = √d, the norm of a
LayerNorm output without its affine part).

Biases, exactly (``bias="keep"``): homogeneous coordinates x̃ = (x, 1) ∈ R^{d+1}.  Head h has
query [r W_{Q,h} | b_{Q,h}], key [r W_{K,h} | b_{K,h}], value_in [W_{V,h} | b_{V,h}/r] and
value_out [W_{O,h}; 0] (a zero last row: the homogeneous coordinate never moves), β = c; one
extra head H+1 with zero query and key (uniform attention, rows summing to 1) carries the output
bias: value_in e_{d+1}ᵀ, value_out (b_O/r, 0).  With ω = 1 ("sum") Σ_h ω_h f_h(x̃) = (MHA(r x)/r, 0)
to rounding.  ``bias="drop"`` removes all four biases (the Θ of the mean-field model on S^{d-1}).

What the heads do not hold (the network's block as a map, and the ladder that removes these one at
a time, are :mod:`transformer_pde.analysis.pretrained`): the LayerNorms (post-LN for the BERT family:
x ← LN₂(h + FF(h)), h = LN₁(x + MHA(x)); pre-LN for GPT-2 and ViT: h = x + MHA(LN₁(x)),
x ← h + FF(LN₂(h))), their mean-centring and affine gain and bias, the token-wise feed-forward
FF(h) = W₂ φ(W₁ h + b₁) + b₂, dropout (off: evaluation mode), positional and token-type
embeddings (they are in the input hidden_states[0]), GPT-2's final LayerNorm.
"""

from __future__ import annotations

import copy
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch

from ..model.heads import Heads
from ..utils.validation import check_choice, check_positive
from .model_files import MINILM_PIP, MINILM_SHA256, check_model_folder, check_width, packaged_minilm, quiet_loading
from .weights import Layerwise

__all__ = ["MINILM_SHA256", "MINILM_PIP", "FAMILIES", "Norm", "LayerWeights", "PretrainedNetwork", "load",
           "packaged_minilm", "layer_heads", "layerwise_from_pretrained"]

#: the architectures read: BERT family (BERT, RoBERTa, MiniLM: post-LN), GPT-2 (causal, pre-LN), ViT (pre-LN)
FAMILIES = ("bert", "gpt2", "vit")
_NEEDS = "pip install 'transformers>=4.40' 'safetensors>=0.4' (or the extra: pip install 'transformer_pde[pretrained]')"


@dataclass(frozen=True)
class Norm:
    """A LayerNorm: LN(x) = γ ⊙ (x − mean x)/√(var x + ε) + b over the last axis (biased variance)."""

    gain: torch.Tensor
    bias: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.gain, self.bias, self.eps)


@dataclass(frozen=True)
class LayerWeights:
    """One block: per-head factors query, key, value (H, k, d) and their biases (H, k); output (H, d, k)
    with output_bias (d,); ``scale`` c of the scores; ``norm1`` (post-LN: after attention, pre-LN: before
    it) and ``norm2`` (the feed-forward's); the feed-forward ff_in (F, d), ff_in_bias (F,), ff_out
    (d, F), ff_out_bias (d,) and its ``activation`` φ (the network's own module)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    query_bias: torch.Tensor
    key_bias: torch.Tensor
    value_bias: torch.Tensor
    output: torch.Tensor
    output_bias: torch.Tensor
    scale: float
    norm1: Norm
    norm2: Norm
    ff_in: torch.Tensor
    ff_in_bias: torch.Tensor
    ff_out: torch.Tensor
    ff_out_bias: torch.Tensor
    activation: Callable

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """FF(h) = W₂ φ(W₁ h + b₁) + b₂, token-wise, (..., n, d)."""
        lin = torch.nn.functional.linear
        return lin(self.activation(lin(h, self.ff_in, self.ff_in_bias)), self.ff_out, self.ff_out_bias)


@dataclass(frozen=True)
class PretrainedNetwork:
    """A pretrained network and its weights (see :func:`load`).

    ``model`` (the transformers model, evaluation mode), ``tokenizer`` (or None), ``family`` in
    :data:`FAMILIES`, ``norm`` "post" | "pre", ``causal``, ``num_layers``, ``dim``, ``num_heads``,
    ``head_dim``, ``layers`` (one :class:`LayerWeights` per block), ``final_norm`` (the LayerNorm the
    network applies to its last hidden state, GPT-2's ln_f, else None)."""

    model: torch.nn.Module
    tokenizer: object
    family: str
    norm: str
    causal: bool
    num_layers: int
    dim: int
    num_heads: int
    head_dim: int
    layers: List[LayerWeights]
    final_norm: Optional[Norm] = None

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].query.dtype


# ---------------------------------------------------------------------------- loading

def _transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised where transformers is missing
        raise ImportError(f"reading pretrained networks needs transformers and safetensors: {_NEEDS}") from e
    return transformers


def _load_folder(folder: pathlib.Path, hidden_size: Optional[int]):
    info = check_model_folder(folder, hidden_size)
    transformers = _transformers()
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # tokenizers raises its own exception types for a damaged file
            raise ValueError(f"{folder / 'tokenizer.json'} cannot be read as a tokenizer ({type(e).__name__}: "
                             f"{str(e)[:160]}); replace it with the network's own tokenizer.json, or remove it to "
                             f"read the network without a tokenizer (then pass token ids)") from None
        vocab = info["vocab_size"]
        if vocab is not None and len(tokenizer) > int(vocab):
            raise ValueError(f"the tokenizer in {folder} has {len(tokenizer)} tokens but the model's embedding has "
                             f"vocab_size = {vocab}: tokenizer and weights do not belong together")
    try:
        with quiet_loading():
            model, loading = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True,
                                                                    attn_implementation="eager",
                                                                    output_loading_info=True)
    except (OSError, RuntimeError, KeyError) as e:
        raise ValueError(f"transformers cannot read the checkpoint {folder} ({type(e).__name__}: {str(e)[:200]}); "
                         f"replace its files with the network's own") from None
    lost = sorted(k for k in loading.get("missing_keys", ()) if not k.startswith("pooler."))
    bad = sorted(str(k) for k in loading.get("mismatched_keys", ()))
    if lost or bad:
        raise ValueError(f"the weights in {folder} do not fill the network config.json describes ("
                         f"{'missing: ' + ', '.join(lost[:3]) if lost else 'another shape: ' + ', '.join(bad[:3])}"
                         f"{', ...' if len(lost or bad) > 3 else ''}); the missing parts would run with random weights. "
                         f"Use the config.json saved with these weights")
    return model, tokenizer


def _path(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _family(layer) -> Optional[str]:
    if _path(layer, "attention.self.query") is not None and _path(layer, "attention.output.LayerNorm") is not None:
        return "bert"
    if _path(layer, "attn.c_attn") is not None and _path(layer, "ln_1") is not None:
        return "gpt2"
    if _path(layer, "layernorm_before") is not None and _path(layer, "layernorm_after") is not None:
        return "vit"
    return None


def _blocks(model):
    """(base model, its list of blocks, family)."""
    base = getattr(model, "base_model", model)
    for where in ("encoder.layer", "h", "layers", "encoder.layers"):
        blocks = _path(base, where)
        if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
            fam = _family(blocks[0])
            if fam is None:
                raise TypeError(
                    f"did not recognise the block {type(blocks[0]).__name__} ({type(base).__name__}.{where}[0]): "
                    f"the readable blocks are the BERT family's (attention.self.query, attention.output.LayerNorm), "
                    f"GPT-2's (attn.c_attn, ln_1) and ViT's (layernorm_before, layernorm_after)")
            return base, blocks, fam
    raise TypeError(f"did not recognise the module {type(base).__name__} (from a {type(model).__name__}): no list of "
                    f"transformer blocks at encoder.layer, h or layers; the readable families are BERT (BERT, RoBERTa, "
                    f"MiniLM), GPT-2 and ViT")


def _linear(module):
    """(W (out, in), b (out,)) of a Linear or of a transformers Conv1D (whose weight is (in, out))."""
    W = module.weight.detach()
    if type(module).__name__ == "Conv1D":
        W = W.t()
    b = module.bias.detach() if getattr(module, "bias", None) is not None else torch.zeros(W.shape[0], dtype=W.dtype,
                                                                                          device=W.device)
    return W, b


def _norm(module) -> Norm:
    d = module.normalized_shape[-1]
    ref = next(module.parameters(), None)
    gain = module.weight.detach() if module.weight is not None else torch.ones(d, dtype=None if ref is None else ref.dtype)
    bias = module.bias.detach() if module.bias is not None else torch.zeros_like(gain)
    return Norm(gain, bias, float(module.eps))


def _split(W, b, H, k):
    """Rows of a (H·k, d) projection as (H, k, d) with the bias as (H, k)."""
    return W.reshape(H, k, W.shape[-1]), b.reshape(H, k)


def _scale(attn, k: int, config=None, layer: int = 0) -> float:
    """c of the scores: the module's own ``scaling`` where it has one, else GPT-2's config rule, else 1/√k."""
    s = getattr(attn, "scaling", None)
    if isinstance(s, (int, float)):
        return float(s)
    c = 1.0 / math.sqrt(k)
    if config is not None and getattr(config, "model_type", "") == "gpt2":
        c = c if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            c /= float(layer + 1)
    return c


def _read_block(block, family: str, H: int, k: int, config=None, index: int = 0) -> LayerWeights:
    if family == "bert":
        sa = block.attention.self
        q, k_, v = _linear(sa.query), _linear(sa.key), _linear(sa.value)
        o = _linear(block.attention.output.dense)
        n1, n2 = _norm(block.attention.output.LayerNorm), _norm(block.output.LayerNorm)
        f1, f2 = _linear(block.intermediate.dense), _linear(block.output.dense)
        act, attn = block.intermediate.intermediate_act_fn, sa
    elif family == "gpt2":
        W, b = _linear(block.attn.c_attn)
        d = W.shape[-1]
        q, k_, v = (W[:d], b[:d]), (W[d:2 * d], b[d:2 * d]), (W[2 * d:], b[2 * d:])
        o = _linear(block.attn.c_proj)
        n1, n2 = _norm(block.ln_1), _norm(block.ln_2)
        f1, f2 = _linear(block.mlp.c_fc), _linear(block.mlp.c_proj)
        act, attn = block.mlp.act, block.attn
    else:  # vit: the current layout (attention.q_proj, mlp.fc1) or the older one (attention.attention.query)
        at = block.attention
        if _path(at, "q_proj") is not None:
            q, k_, v, o = _linear(at.q_proj), _linear(at.k_proj), _linear(at.v_proj), _linear(at.o_proj)
            f1, f2, act, attn = _linear(block.mlp.fc1), _linear(block.mlp.fc2), block.mlp.activation_fn, at
        elif _path(at, "attention.query") is not None:
            sa = at.attention
            q, k_, v, o = _linear(sa.query), _linear(sa.key), _linear(sa.value), _linear(at.output.dense)
            f1, f2 = _linear(block.intermediate.dense), _linear(block.output.dense)
            act, attn = block.intermediate.intermediate_act_fn, sa
        else:
            raise TypeError(f"did not recognise the attention module {type(at).__name__} of the ViT block "
                            f"{type(block).__name__}: expected q_proj/k_proj/v_proj/o_proj or attention.query")
        n1, n2 = _norm(block.layernorm_before), _norm(block.layernorm_after)
    (Q, bq), (K, bk), (V, bv) = _split(*q, H, k), _split(*k_, H, k), _split(*v, H, k)
    Wo, bo = o
    O = Wo.reshape(Wo.shape[0], H, k).permute(1, 0, 2).contiguous()  # (H, d, k): columns h·k … (h+1)·k − 1 of W_O
    return LayerWeights(Q, K, V, bq, bk, bv, O, bo, _scale(attn, k, config, index), n1, n2, f1[0], f1[1], f2[0], f2[1],
                        act)


def _check_config(config, family: str):
    if family == "bert":
        kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type={kind!r} adds relative-position terms to the scores, which the "
                             f"heads cannot hold; only 'absolute' is read")
        if getattr(config, "is_decoder", False):
            raise ValueError("a BERT-family decoder (is_decoder=True) is not read; use the encoder")


def load(model_or_folder, *, dtype: Optional[torch.dtype] = None, hidden_size: Optional[int] = None,
         tokenizer=None) -> PretrainedNetwork:
    """Read a pretrained network: a transformers model object, or a checkpoint folder (config.json,
    model.safetensors, optionally tokenizer.json) loaded offline (``local_files_only=True``, eager attention).

    Parameters
    ----------
    model_or_folder
        a transformers model (BertModel, RobertaModel, GPT2Model, ViTModel, or a model with a head around one
        of these), a folder path, or a :class:`PretrainedNetwork` (returned as it is, converted to ``dtype``).
    dtype : torch.dtype, optional
        convert the network (a copy of a given model object) to this dtype, e.g. ``torch.float64``.
    hidden_size : int, optional
        the width d the caller expects; another width is refused before the weights are read.
    tokenizer
        a tokenizer to attach to a model object (a folder's tokenizer.json is loaded itself).

    Returns
    -------
    PretrainedNetwork
        :class:`PretrainedNetwork` (the model in evaluation mode).

    Raises
    ------
    ImportError
        transformers is not installed.
    TypeError
        an object that is not a torch module with a ``config``; an architecture not recognised (the message
        names the module).
    ValueError
        a missing file, a tokenizer larger than the model's vocabulary, another hidden size than asked,
        relative-position scores.
    """
    if isinstance(model_or_folder, PretrainedNetwork):
        net = model_or_folder
        check_width(net.dim, hidden_size, "the network")
        if dtype is None or dtype == net.dtype:
            return net
        return load(net.model, dtype=dtype, tokenizer=net.tokenizer)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.float64), got {dtype!r}")
    if isinstance(model_or_folder, (str, os.PathLike)):
        model, tok = _load_folder(pathlib.Path(model_or_folder).expanduser(), hidden_size)
        tokenizer = tok if tokenizer is None else tokenizer
    elif isinstance(model_or_folder, torch.nn.Module) and getattr(model_or_folder, "config", None) is not None:
        model = model_or_folder
        width = getattr(model.config, "hidden_size", None)
        if width is not None:
            check_width(width, hidden_size, f"the {type(model).__name__}")
        if dtype is not None and next(model.parameters()).dtype != dtype:
            model = copy.deepcopy(model)
    else:
        raise TypeError(f"expected a transformers model (a torch.nn.Module with .config), a checkpoint folder or a "
                        f"PretrainedNetwork; got {type(model_or_folder).__name__}")
    base, blocks, family = _blocks(model)
    config = model.config
    _check_config(config, family)
    if dtype is not None:
        model = model.to(dtype)
    model.eval()
    d = int(getattr(config, "hidden_size"))
    H = int(getattr(config, "num_attention_heads"))
    if d % H:
        raise ValueError(f"hidden size {d} is not a multiple of the {H} heads")
    k = d // H
    layers = [_read_block(b, family, H, k, config, i) for i, b in enumerate(blocks)]
    final = _norm(base.ln_f) if family == "gpt2" else None
    return PretrainedNetwork(model=model, tokenizer=tokenizer, family=family, norm="post" if family == "bert" else "pre",
                             causal=family == "gpt2", num_layers=len(layers), dim=d, num_heads=H, head_dim=k,
                             layers=layers, final_norm=final)


# ---------------------------------------------------------------------------- Θ_t

def _weights(head_weights, H: int, extra: int, ref: torch.Tensor):
    if isinstance(head_weights, str):
        check_choice(head_weights, ("sum", "mean"), "head_weights")
        c = 1.0 if head_weights == "sum" else 1.0 / H
        return torch.full((H + extra,), c, dtype=ref.dtype, device=ref.device)
    if isinstance(head_weights, torch.Tensor):
        if head_weights.shape[-1] != H + extra:
            raise ValueError(f"head_weights must have shape (..., {H + extra})"
                             + (" (the last for the output-bias head of bias='keep')" if extra else "")
                             + f", got {tuple(head_weights.shape)}")
        return head_weights.to(dtype=ref.dtype, device=ref.device)
    raise TypeError(f"head_weights must be 'sum', 'mean' or a tensor (..., H), got {type(head_weights).__name__}")


def layer_heads(layer: LayerWeights, *, bias: str = "drop", token_norm: float = 1.0,
                head_weights: Union[str, torch.Tensor] = "sum") -> Heads:
    """The heads of one block (module docstring): ``bias="drop"``: H heads on R^d, β = r²c, factors kept;
    ``bias="keep"``: H + 1 heads in homogeneous coordinates R^{d+1}, β = c, exact with the biases."""
    check_choice(bias, ("drop", "keep"), "bias")
    r = check_positive(token_norm, "token_norm")
    Q, K, Wv, O = layer.query, layer.key, layer.value, layer.output
    H, k, d = Q.shape
    if bias == "drop":
        return Heads(None, None, _weights(head_weights, H, 0, Q), r * r * layer.scale, query=Q, key=K,
                     value_in=Wv, value_out=O)
    col = lambda b: b.unsqueeze(-1)  # noqa: E731  (H, k) -> (H, k, 1)
    Qt = torch.cat([r * Q, col(layer.query_bias)], -1)
    Kt = torch.cat([r * K, col(layer.key_bias)], -1)
    Vin = torch.cat([Wv, col(layer.value_bias) / r], -1)
    Vout = torch.cat([O, O.new_zeros(H, 1, k)], -2)
    # the output-bias head: zero scores, value map x̃ ↦ (b_O/r, 0) through the homogeneous coordinate
    zq = Q.new_zeros(1, k, d + 1)
    bin_ = Q.new_zeros(1, k, d + 1)
    bin_[0, 0, d] = 1.0
    bout = Q.new_zeros(1, d + 1, k)
    bout[0, :d, 0] = layer.output_bias / r
    return Heads(None, None, _weights(head_weights, H, 1, Q), layer.scale, query=torch.cat([Qt, zq]),
                 key=torch.cat([Kt, zq]), value_in=torch.cat([Vin, bin_]), value_out=torch.cat([Vout, bout]))


def layerwise_from_pretrained(model_or_folder, *, bias: str = "drop", head_weights: Union[str, torch.Tensor] = "sum",
                              token_norm: Optional[float] = None, dtype: Optional[torch.dtype] = None,
                              hidden_size: Optional[int] = None, interpolation: str = "constant",
                              layer_time: float = 1.0, t0: float = 0.0) -> Layerwise:
    """Θ_t of a pretrained network: layer l's heads (A_h = c W_{Q,h}ᵀW_{K,h}, V_h = W_{O,h}W_{V,h}, factors kept)
    on [t0 + l·Δ, t0 + (l+1)·Δ), Δ = ``layer_time``.

    Parameters
    ----------
    model_or_folder
        what :func:`load` reads (a transformers model, a checkpoint folder, a PretrainedNetwork).
    bias : str
        "drop" (the four attention biases removed: heads on R^d, the mean-field model) or "keep" (exact:
        H + 1 heads in homogeneous coordinates R^{d+1} acting on (x, 1), module docstring).
    head_weights : Union[str, torch.Tensor]
        "sum" (ω_h = 1: the network's sum over heads), "mean" (1/H) or a tensor (..., H) (H + 1 with "keep").
    token_norm : float, optional
        r, the norm of the tokens the attention reads; None means √d (a LayerNorm output without affine).
    dtype, hidden_size
        as in :func:`load`.
    interpolation, layer_time, t0
        as in :class:`~transformer_pde.Layerwise`.

    Returns
    -------
    Layerwise
        one :class:`~transformer_pde.Heads` per block (batch shape ()).

    Raises
    ------
    ValueError, TypeError
        as :func:`load`; an unknown ``bias``, bad head weights.
    """
    check_choice(bias, ("drop", "keep"), "bias")
    net = load(model_or_folder, dtype=dtype, hidden_size=hidden_size)
    r = math.sqrt(net.dim) if token_norm is None else check_positive(token_norm, "token_norm")
    layers = [layer_heads(w, bias=bias, token_norm=r, head_weights=head_weights) for w in net.layers]
    return Layerwise(layers, interpolation=interpolation, layer_time=layer_time, t0=t0)
