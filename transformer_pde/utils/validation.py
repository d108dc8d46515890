"""Input checks shared by the public entry points.

Every check raises ``TypeError`` (wrong kind of object, dtype, device) or
``ValueError`` (wrong shape or value) with a message that says what was wrong and
how to fix it.  Checks run once, at the entry point, before any work is done; the
hot loops call the private kernels directly.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Mapping

import torch

DIRECTIONS = ("ascent", "descent")
#: the one default of every ``direction=`` of the library: "ascent", the residual transformer
#: x + attention(x) (tokens cluster when A ≻ 0); the paper's reference code steps "descent" and its
#: reproductions pass it explicitly
DEFAULT_DIRECTION = "ascent"
DTYPES = (torch.float32, torch.float64)


def sphere_tolerance(dtype: torch.dtype) -> float:
    """How far from |x| = 1 a token may be: 1e-6 in float64, ~1e-4 in float32."""
    return max(1e-6, 1e3 * torch.finfo(dtype).eps)


def check_choice(value, allowed: Iterable[str], name: str) -> str:
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(repr, allowed))}")
    return value


def direction_sign(direction: str) -> float:
    """``+1`` for "ascent" (x + attention(x)), ``-1`` for "descent" (the reference code)."""
    check_choice(direction, DIRECTIONS, "direction")
    return 1.0 if direction == "ascent" else -1.0


def check_tensor(x, name: str, *, min_dim: int = 0) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor, got {type(x).__name__}; wrap it with torch.as_tensor(...)"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must have a floating dtype (float32 or float64), got {x.dtype}; "
            f"convert it with {name}.double() or {name}.float()"
        )
    if x.dtype not in DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; the kernels need float32 or float64 (in half precision e^(β⟨Ax, y⟩) "
            f"overflows for β⟨Ax, y⟩ > 11); convert it with {name}.float() or {name}.double()"
        )
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds shapes but no values: nothing can be computed "
                         f"from it; create it on a real device (e.g. {name}.to_empty(device='cpu') then fill it, or "
                         f"build it on 'cpu' or 'cuda')")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf values; remove or replace them before calling")
    return x


def check_same(reference: torch.Tensor, other: torch.Tensor, ref_name: str, name: str) -> None:
    """Refuse mixed devices or dtypes, with a hint (as geomloss does)."""
    if other.device != reference.device:
        raise ValueError(
            f"{name} is on {other.device} but {ref_name} is on {reference.device}; "
            f"move them to one device with .to({ref_name}.device)"
        )
    if other.dtype != reference.dtype:
        raise TypeError(
            f"{name} has dtype {other.dtype} but {ref_name} has dtype {reference.dtype}; "
            f"convert with .to({ref_name}.dtype)"
        )


def check_tokens(x, name: str = "x") -> torch.Tensor:
    """x: (..., n, d) unit vectors, d >= 2, n >= 1."""
    check_tensor(x, name, min_dim=2)
    n, d = x.shape[-2], x.shape[-1]
    if d < 2:
        raise ValueError(f"{name} must have shape (..., n, d) with d >= 2, got shape {tuple(x.shape)}")
    if n < 1:
        raise ValueError(f"{name} holds no tokens (n = 0): shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} holds no token sets (an empty batch): its batch shape {tuple(x.shape[:-2])} has an empty axis "
                         f"(shape {tuple(x.shape)}); give at least one set of tokens, e.g. shape (1, {n}, {d})")
    err = (x.norm(dim=-1) - 1).abs().max().item()
    tol = sphere_tolerance(x.dtype)
    if err > tol:
        hint = ""
        if d > 2 and bool(((x[..., -1] - 1).abs() <= tol).all()):  # homogeneous tokens (x, 1)
            hint = (" (tokens (x, 1) of bias-keeping heads, layerwise_from_pretrained(bias='keep'): normalising "
                    "them changes the scores; use tp.pretrained.homogeneous_outputs / homogeneous_velocity)")
        raise ValueError(
            f"{name} is not on the unit sphere: max | |x|-1 | = {err:.1e} > {tol:.0e}; "
            f"normalise with x / x.norm(dim=-1, keepdim=True){hint}"
        )
    return x


def check_token_weights(w, x: torch.Tensor, name: str = "weights", x_name: str = "x"):
    """w: (..., n) non-negative, summing to 1, or None (uniform)."""
    if w is None:
        return None
    check_tensor(w, name, min_dim=1)
    check_same(x, w, x_name, name)
    n = x.shape[-2]
    if w.shape[-1] != n:
        raise ValueError(
            f"{name} must have shape (..., n) with n = {n} tokens, got shape {tuple(w.shape)}"
        )
    try:
        broadcast_shapes(w.shape[:-1], x.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the batch shape of {name} {tuple(w.shape[:-1])} does not broadcast against "
            f"the batch shape of {x_name} {tuple(x.shape[:-2])}"
        ) from None
    if w.numel() == 0:
        raise ValueError(f"{name} has an empty batch (shape {tuple(w.shape)}): its batch shape has an empty axis; give at "
                         f"least one set of weights")
    if bool((w < 0).any()):
        raise ValueError(f"{name} has negative entries (min {w.min().item():.3g}); token weights must be >= 0")
    err = (w.sum(-1) - 1).abs().max().item()
    tol = sphere_tolerance(w.dtype)
    if err > tol:
        raise ValueError(
            f"{name} must sum to 1 over the tokens (max |sum - 1| = {err:.1e}); "
            f"normalise with {name} / {name}.sum(-1, keepdim=True)"
        )
    return w


def check_positive(value, name: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not math.isfinite(value) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def check_bool(value, name: str, *, allow_none: bool = False):
    """A flag: True or False (or None where ``allow_none``); TypeError for anything else, e.g. the
    string "yes" that a plain ``if value:`` would silently take for True."""
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    extra = ", False or None" if allow_none else " or False"
    raise TypeError(f"{name} must be True{extra}, got {type(value).__name__} {value!r}")


def check_int(value, name: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_real(value, name: str) -> float:
    """A finite real number (int, float, numpy scalar or one-element tensor) as a float.

    Raises TypeError for strings, bools and other objects ("t1 must be a real number, got str '1'")
    and ValueError for NaN / inf."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a tensor of shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_seed(value, name: str = "seed") -> int:
    """A seed for torch.Generator.manual_seed: an int in [0, 2^64)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int (a random seed in [0, 2^64)), got {type(value).__name__} {value!r}")
    value = int(value)
    if not 0 <= value < 2 ** 64:
        raise ValueError(f"{name} must lie in [0, 2^64) (torch.Generator.manual_seed), got {value}")
    return value


def check_horizon(times: torch.Tensor, t0: float, t1: float, name: str = "the weight path",
                  fix: str = "sample it again with tp.sample_path(process, t1=..., dt=...) up to t1") -> None:
    """Refuse replaying a stored path ``times`` (K+1,) on [t0, t1] when it does not cover it.

    Raises ValueError naming the path's horizon and the requested interval (up to a relative
    slack of 1e-9 of the horizon)."""
    lo, hi = float(times[0]), float(times[-1])
    slack = 1e-9 * max(1.0, abs(hi), abs(lo))
    if t0 < lo - slack or t1 > hi + slack:
        raise ValueError(f"{name} covers [{lo:.6g}, {hi:.6g}] (its horizon is t = {hi:.6g}) but the run asks for "
                         f"[{t0:.6g}, {t1:.6g}] (t1 = {t1:.6g}); {fix}")


def check_tied(heads, purpose: str) -> None:
    """Refuse heads whose values are not tied to the scores (V_h ≠ A_h) where only A enters.

    ``purpose`` names the caller, e.g. "normalization='effective'" or "jko".  The energy
    E = Σ_h ω_h/(2β) ∫∫ e^{β⟨A_h x, y⟩} and its gradient flow (the effective field, the JKO
    scheme) depend on the scores A only: given untied values they would silently ignore them."""
    value = getattr(heads, "value", None)
    if value is None:
        return
    A = heads.score_matrix
    if value.shape == A.shape and bool(torch.equal(value, A)):
        return
    raise ValueError(
        f"{purpose} is the gradient flow of the energy E = Σ_h ω_h/(2β) ∫∫ e^(β⟨A_h x, y⟩) dμ dμ, which depends "
        f"on the scores A_h only, but these heads carry values V_h ≠ A_h that it would silently ignore; use tied "
        f"heads (value=None, V_h = A_h; symmetric A_h for the paper's setting), or normalization='softmax' / "
        f"'unnormalized' with tp.simulate for untied values"
    )


def check_tied_all(theta, purpose: str) -> None:
    """:func:`check_tied` for Heads or a weight process: its ``heads0``, every ``layers`` entry
    (Layerwise) and the ``template`` of a stored WeightPath (duck-typed: no import of processes)."""
    heads = [theta] if hasattr(theta, "score_matrix") else [getattr(theta, "heads0", None)]
    heads += list(getattr(theta, "layers", None) or []) + [getattr(theta, "template", None)]
    for h in heads:
        if h is not None:
            check_tied(h, purpose)


def check_seed_generator(seed, generator, name: str = "seed"):
    """``seed=`` / ``generator=`` of a random entry point: the seed as an int (None means 0).

    ValueError when both are given (the generator would silently win: its own state decides the draws);
    TypeError for a generator that is not a torch.Generator."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if seed is None:
        return 0
    if generator is not None:
        raise ValueError(f"give either {name}= or generator=, not both: with a generator the draws come from its "
                         f"state and {name}={seed!r} would be ignored; seed the generator instead "
                         f"(torch.Generator().manual_seed({seed!r}))")
    return check_seed(seed, name)


def check_every(value, name: str, steps: int, horizon: str) -> int:
    """An ``every k steps`` option (record_every, checkpoint_every) as an int in [1, steps].

    A k above the number of steps would keep only the first and last step (one interval: time
    averages and fits then come from one record) or never act; ValueError naming the horizon."""
    k = check_int(value, name)
    if k > steps:
        raise ValueError(f"{name} = {k} is larger than the number of steps of the run ({steps}: {horizon}); "
                         f"choose {name} <= {steps}, or lengthen the run")
    return k


#: the default of ``max_steps=`` (simulate, jko, sample_path): more steps are refused before any work
MAX_STEPS = 10 ** 7

#: the default of ``max_memory=`` as a fraction of the machine's memory (physical RAM, or the GPU's)
MEMORY_FRACTION = 0.75


def machine_memory(device=None) -> int:
    """Bytes of memory of the device: the GPU's total memory for CUDA tensors, else the physical RAM
    (os.sysconf; 16 GiB when the platform does not tell)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(dev).total_memory)
    try:
        import os

        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2 ** 30


def _format_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if b < 1024 or unit == "PiB":
            return f"{b:.3g} {unit}"
        b /= 1024
    return f"{b:.3g} PiB"  # pragma: no cover


def check_limits(what: str, *, steps: int, memory: Mapping, max_steps, max_memory, device=None, fix: str = "") -> None:
    """Refuse a run before any allocation when its step count or its memory estimate exceeds the limits.

    ``memory`` maps the names of the large arrays to their estimated bytes; ``max_steps`` (None:
    :data:`MAX_STEPS`) and ``max_memory`` (bytes; None: :data:`MEMORY_FRACTION` of
    :func:`machine_memory`; ``float("inf")``: no limit) are the user's limits.  ValueError with the
    estimate and the fix."""
    max_steps = MAX_STEPS if max_steps is None else check_int(max_steps, "max_steps")
    if max_memory is None:
        limit, given = MEMORY_FRACTION * machine_memory(device), False
    elif isinstance(max_memory, float) and max_memory == math.inf:
        limit, given = math.inf, True  # no limit, as asked
    else:
        limit, given = check_positive(max_memory, "max_memory"), True
    if steps > max_steps:
        raise ValueError(f"{what} would take {steps:.4g} steps, more than max_steps = {max_steps:.4g}; use a larger "
                         f"step (dt / tau) or a shorter horizon, or pass max_steps={steps} if you mean it")
    total = float(sum(memory.values()))
    if total > limit:
        parts = ", ".join(f"{k} {_format_bytes(v)}" for k, v in sorted(memory.items(), key=lambda kv: -kv[1]) if v)
        where = "max_memory" if given else (f"max_memory (default {MEMORY_FRACTION:g} of this machine's "
                                            f"{_format_bytes(limit / MEMORY_FRACTION)})")
        raise ValueError(f"{what} would need about {_format_bytes(total)} ({parts}), more than {where} = "
                         f"{_format_bytes(limit)}; {fix + ', or ' if fix else ''}pass max_memory={int(total * 1.25)} "
                         f"(bytes) if the machine has it")

def check_output_file(path, name: str = "checkpoint"):
    """``path`` as a Path when a file can be written there: its folder exists, is a folder and is writable, and
    ``path`` is not a folder itself.  ValueError (with the fix) otherwise; nothing is created.  Run before any
    work, so that a run does not fail at its first write."""
    import os
    from pathlib import Path

    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    try:
        if p.is_dir():
            raise ValueError(f"{name} {p} is a folder; give a file name inside it, e.g. {p / 'run.ckpt'}")
        if not folder.exists():
            raise ValueError(f"{name} {p}: the folder {folder} does not exist; create it first "
                             f"(os.makedirs({str(folder)!r})) or choose a path in an existing folder")
        if not folder.is_dir():
            raise ValueError(f"{name} {p}: {folder} is not a folder; choose a path in an existing folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"{name} {p}: cannot write in {folder} (permission denied); choose a writable folder")
    except OSError as e:  # e.g. a name too long for the file system
        raise ValueError(f"{name} {str(p)[:80]} cannot be looked up ({e.strerror or e}); choose another path") from None
    return p


class WriteError(OSError):
    """Writing a file failed because the disk (or the quota, or the file size limit) is full; the message names
    the file and what to do (``errno`` and ``filename`` are set)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


_TORCH_WRITE_FAILURES = ("inline_container", "PytorchStreamWriter", "file write failed", "unexpected pos")


def write_error(path, exc: BaseException):
    """A :class:`WriteError` naming ``path`` when ``exc`` is the failure of a write for lack of space (ENOSPC,
    EDQUOT), of a file size limit (EFBIG), or torch's writer failing ("[enforce fail at inline_container.cc...]",
    which is what ``torch.save`` raises on a full disk); None for any other error."""
    import errno
    import os
    import shutil

    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    torch_failed = isinstance(exc, RuntimeError) and any(m in str(exc) for m in _TORCH_WRITE_FAILURES)
    if code not in (errno.ENOSPC, getattr(errno, "EDQUOT", -1), errno.EFBIG) and not torch_failed:
        return None
    fix = "then resume (transformer-pde: --resume; tp.simulate: the same call with the same checkpoint)"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    try:
        import resource

        fsize = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        fsize = None if fsize == resource.RLIM_INFINITY else fsize
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        fsize = None
    free_text = "" if free is None else f" ({_format_bytes(free)} free on that file system)"
    if code == errno.EFBIG or (torch_failed and fsize is not None and (free is None or free > fsize)):
        limit = "" if fsize is None else f" of {_format_bytes(fsize)}"
        err = WriteError(f"the file size limit{limit} (ulimit -f) was reached while writing {path}; raise it, "
                         f"{fix}")
        err.errno = errno.EFBIG
    elif torch_failed and free is not None and free > 64 * 2 ** 20:  # not for lack of space: say what failed
        err = WriteError(f"writing {path} failed ({str(exc).splitlines()[0][:120]}){free_text}; check the disk, "
                         f"{fix}")
        err.errno = errno.EIO
    else:
        err = WriteError(f"disk full while writing {path}{free_text}; free space, {fix}")
        err.errno = errno.ENOSPC
    err.filename = str(path)
    return err


def broadcast_shapes(*shapes) -> torch.Size:
    """``torch.broadcast_shapes`` for plain shapes, without its first-call cost.

    torch's version goes through ``torch._refs``, whose first call imports sympy (0.4–2.5 s of a
    run's setup, docs/performance.md); this is the same rule in plain Python.

    Raises
    ------
    RuntimeError
        the shapes do not broadcast (as torch's, so callers catch the same error).
    """
    r = max((len(s) for s in shapes), default=0)
    out = [1] * r
    for s in shapes:
        for i, v in enumerate(s, r - len(s)):
            v = int(v)
            if v < 0:
                raise RuntimeError(f"broadcast_shapes: negative dimension in {tuple(s)}")
            if v != 1:
                if out[i] != 1 and out[i] != v:
                    raise RuntimeError(f"shapes {[tuple(t) for t in shapes]} do not broadcast")
                out[i] = v
    return torch.Size(out)
