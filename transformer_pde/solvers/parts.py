"""The small parts every solver is composed of (see ARCHITECTURE.md).

* :class:`Stepper` — one explicit Runge–Kutta step (a Butcher tableau) followed by the retraction
  onto the sphere, or none for flat dynamics;
* :class:`Ledger` — the running energy ledger (left-point or trapezoid quadrature of ∂_sE, 𝒟 and
  𝒢², the martingale, jumps), :func:`ledger_terms` (the residuals) and
  :func:`ledger_from_series` (the same ledger from series on a record grid, for "adaptive");
* :class:`Recorder` — which steps to keep, the per-record lists, the stacked series;
* :class:`Checkpointer` — fingerprint, atomic save every k steps, resume or refuse;
* :func:`progress_bar` — the tqdm bar (on a terminal only) or nothing.

The Θ_t grid driver is :class:`transformer_pde.processes.weights.WeightDriver`.  Everything here is a named
internal API: used by the solvers of this package, not part of the public API.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

from ..model.energy import ito_correction, pairing
from ..utils.validation import check_output_file, write_error
from ..model.heads import Heads
from ..dynamics.layernorm import as_geometry, check_layer_norm_method

#: the parts a solver is composed of (docs/solve.md, "A solver of your own")
__all__: List[str] = ["Stepper", "Ledger", "Recorder", "Checkpointer", "progress_bar", "partial_density", "ledger_terms",
                      "ledger_from_series", "LEDGER_KEYS"]
__internal__ = ["check_observables", "observe", "process_signature", "process_parts", "callable_signature"]

LEDGER_KEYS = ("dE", "partial", "dissipation", "slope", "martingale", "residual", "residual_slope")


# ---------------------------------------------------------------------------- stepper
class Stepper:
    """One explicit Runge–Kutta step x ↦ x_new of ẋ = F(x, t) for a tableau (c, a, b).

    retract=True: the stages and the result are pulled back to the unit sphere by the geometry's
    retraction (``geometry.retract``, x ↦ x/|x| for every scheme of
    :mod:`~transformer_pde.dynamics.layernorm`; the geometry seam); False: flat dynamics in R^d.

    ``geometry``: the geometry of the step, a :class:`~transformer_pde.dynamics.layernorm.LayerNormScheme`
    (or its name).  "none" (default, :class:`~.layernorm.Projected`) is the Runge–Kutta step with
    the retraction above; the other schemes are discrete layer maps (one attention evaluation per
    layer, Euler tableau only), taken by :meth:`layer_step`."""

    def __init__(self, tableau, retract: bool = True, geometry="none"):
        self.tableau = tableau
        self.retract = retract
        self.geometry = as_geometry(geometry)
        check_layer_norm_method(self.geometry, getattr(tableau, "name", "?"))

    @property
    def projected(self) -> bool:
        """True when :meth:`step` (Runge–Kutta + retraction) makes the step, False for a layer map."""
        return self.geometry.projected

    def layer_step(self, x: torch.Tensor, radius, update: torch.Tensor, dt: float):
        """The scheme's layer map at (x, r) with the signed un-projected attention update A (..., n, d).

        Returns (x_new, r_new or None, the largest |‖y‖ − 1| before normalising)."""
        return self.geometry.step(x, radius, update, dt)

    def step(self, x: torch.Tensor, k1: torch.Tensor, dt: float, stage_field: Callable):
        """x (..., n, d), k1 = F(x) at the left end, stage_field(x_stage, c_i) the field at stage i.

        Returns (x_new, the largest |‖y‖ − 1| before the retraction (0 for flat dynamics))."""
        tab = self.tableau
        ks = [k1]
        for i in range(1, tab.stages):
            xs = x
            for j, aij in enumerate(tab.a[i]):
                if aij != 0.0:
                    xs = xs + (dt * aij) * ks[j]
            if self.retract:
                xs = self.geometry.retract(xs)
            ks.append(stage_field(xs, tab.c[i]))
        y = x
        for bi, ki in zip(tab.b, ks):
            y = y + (dt * bi) * ki
        if not self.retract:
            return y, 0.0
        return self.geometry.retract_step(y)


# ---------------------------------------------------------------------------- ledger
def partial_density(x, heads: Heads, weights, stats, rate, sigma, *, ito: bool, log_scale: float = 0.0):
    """∂_tE = e^{−c}⟨∂_A E, Ȧ⟩, plus the expected Itô correction when ``ito``, (...,)."""
    pt = pairing(x, heads, weights, stats, rate, log_scale=log_scale)
    if ito:
        pt = pt + ito_correction(heads, weights, stats, sigma, log_scale=log_scale)
    return pt


def ledger_terms(dE, partial, dissipation, slope, martingale, *, sign: float, causal: bool = False) -> Dict:
    """The ledger entries (:data:`LEDGER_KEYS`): the running terms and the residuals
    dE − ∫∂_sE − ∫𝒟 − M and dE − ∫∂_sE − s∫𝒢² − M (none for causal attention: no gradient flow)."""
    out = {"dE": dE, "partial": partial, "dissipation": dissipation, "slope": slope, "martingale": martingale}
    if not causal:
        rest = dE - partial - martingale
        out["residual"] = rest - dissipation
        out["residual_slope"] = torch.sub(rest, slope, alpha=sign) if isinstance(rest, torch.Tensor) \
            else rest - sign * slope
    return out


class Ledger:
    """The running energy ledger of a fixed-step solve (docs/model.md#ledger).

    ``quadrature`` "left" or "trapezoid" for the time integrals of the densities ∂_sE, 𝒟, 𝒢²; the
    martingale and the realised quadratic variation are Itô sums (left end), added by the solver
    through :meth:`add`; jumps of piecewise-constant weights through :meth:`add` to "partial"."""

    def __init__(self, E0: torch.Tensor, *, sign: float, quadrature: str = "left", causal: bool = False,
                 acc: Optional[Mapping] = None, extra: Sequence[str] = ()):
        """``acc``: the running sums of a resumed run (its checkpoint's); ``extra``: more running terms (from 0)."""
        zero = torch.zeros_like(E0)
        self.acc = {"E0": E0, "partial": zero, "dissipation": zero, "slope": zero, "martingale": zero,
                    **{key: zero for key in extra}} if acc is None else dict(acc)
        self.sign, self.quadrature, self.causal = sign, quadrature, causal

    def add(self, key: str, value):
        self.acc[key] = self.acc[key] + value

    def integrate(self, dens: Mapping, dens_new: Mapping, dt: float):
        """Add dt × (left value, or the mean of both ends) of each density (a density None is 0)."""
        left = self.quadrature == "left"
        for key in ("partial", "dissipation", "slope"):
            a, b = dens[key], None if left else dens_new[key]
            if a is None and b is None:
                continue
            if left:
                inc = a
            elif a is None or b is None:
                inc = 0.5 * (a if b is None else b)
            else:
                inc = 0.5 * (a + b)
            self.acc[key] = self.acc[key] + dt * inc

    def terms(self, energy: torch.Tensor) -> Dict:
        a = self.acc
        return ledger_terms(energy - a["E0"], a["partial"], a["dissipation"], a["slope"], a["martingale"],
                            sign=self.sign, causal=self.causal)


def ledger_from_series(E, G, D, P, M: Sequence, Q: Sequence, times, *, sign: float, causal: bool = False) -> Dict:
    """The ledger from series on a record grid: trapezoid integrals of ∂_sE (P), 𝒟, 𝒢², Itô sums of
    the martingale increments M and the realised quadratic variation Q (one per interval)."""
    dts = (times[1:] - times[:-1]).to(E.dtype).reshape(-1, *([1] * (E.dim() - 1)))
    first = torch.zeros_like(E[:1])

    def cum(v):
        return torch.cat([first, torch.cumsum(dts * 0.5 * (v[1:] + v[:-1]), 0)])

    Mc = torch.cat([first, torch.cumsum(torch.stack(list(M)), 0)]) if M else torch.zeros_like(E)
    partial = cum(P)
    if Q:
        partial = partial + torch.cat([first, torch.cumsum(torch.stack(list(Q)), 0)])
    return ledger_terms(E - E[0], partial, cum(D), cum(G), Mc, sign=sign, causal=causal)


# ---------------------------------------------------------------------------- recorder
def check_observables(observables) -> Dict[str, Callable]:
    """``observables=`` as a dict of str -> callable (TypeError otherwise, before any work)."""
    if observables is None:
        return {}
    if not isinstance(observables, Mapping):
        raise TypeError(f"observables must be a mapping name -> callable(x, weights) (e.g. "
                        f"{{'mean': lambda x, w: x.mean(-2)}}), got {type(observables).__name__}")
    out = {}
    for name, fn in observables.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"observables: every name must be a non-empty string, got {name!r}")
        if not callable(fn):
            raise TypeError(f"observables[{name!r}] must be a callable(x, weights) returning a tensor, "
                            f"got {type(fn).__name__}")
        out[name] = fn
    return out


def observe(name: str, fn: Callable, x: torch.Tensor, weights) -> torch.Tensor:
    """One observable at one recorded time, checked: a tensor of shape (*batch,) or (*batch, k)."""
    v = fn(x, weights)
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"observables[{name!r}] returned {type(v).__name__}; it must return a tensor of shape "
                        f"(*batch,) or (*batch, k) for tokens of shape (*batch, n, d)")
    batch = tuple(x.shape[:-2])
    if tuple(v.shape[:len(batch)]) != batch or v.dim() not in (len(batch), len(batch) + 1):
        raise ValueError(f"observables[{name!r}] returned shape {tuple(v.shape)}; for tokens of shape "
                         f"{tuple(x.shape)} it must be {batch} or {batch + ('k',)}")
    return v.detach() if not v.requires_grad else v


class Recorder:
    """Keeps every ``every``-th of the steps 0..K (and K), and stacks them into a Trajectory's series.

    ``records`` (name -> list) is plain data, so a checkpoint can store and restore it."""

    def __init__(self, K: int, every: int, *, diagnostics: bool, observables: Optional[Mapping] = None,
                 weights=None, ledger_keys=LEDGER_KEYS, records: Optional[Mapping] = None, extra: Sequence[str] = ()):
        """``records``: the records of a resumed run (its checkpoint's); ``extra``: more per-record lists."""
        self.steps = sorted(set(range(0, K + 1, every)) | {K})
        self._keep = set(self.steps)
        self.diagnostics, self.weights, self.ledger_keys = diagnostics, weights, ledger_keys
        self.observables = dict(observables or {})
        self.records: Dict[str, List[torch.Tensor]] = {"x": []}
        if diagnostics:
            for key in ("energy", "slope", "dissipation", *("ledger." + k for k in LEDGER_KEYS)):
                self.records[key] = []
        for name in self.observables:
            self.records["obs." + name] = []
        for key in extra:
            self.records[key] = []
        if records is not None:
            self.records = {key: list(v) for key, v in records.items()}

    def keeps(self, k: int) -> bool:
        return k in self._keep

    def record(self, x: torch.Tensor, energy=None, slope=None, dissipation=None, ledger: Optional[Mapping] = None,
               observe_x: Optional[torch.Tensor] = None):
        """Append one recorded time: tokens x, with diagnostics the series and the ledger entries;
        the observables are evaluated at ``observe_x`` (default x)."""
        r = self.records
        r["x"].append(self._slot(x) if not x.requires_grad else x)
        if self.diagnostics:
            r["energy"].append(energy)
            r["slope"].append(slope)
            r["dissipation"].append(dissipation)
            for key, v in ledger.items():
                r["ledger." + key].append(v)
        xo = x if observe_x is None else observe_x
        for name, fn in self.observables.items():
            r["obs." + name].append(observe(name, fn, xo, self.weights))

    def _slot(self, x: torch.Tensor) -> torch.Tensor:
        """x (no grad) copied into the next slot of one (T, ...) buffer of the run's records, allocated at the
        first record: no fresh memory per recorded step and no copy of every record at the end (:meth:`stacked`
        returns the buffer itself when it holds them all).  A state of another shape, dtype or device than the
        buffer's (never in a solve) is kept as it is."""
        i, buf = len(self.records["x"]), getattr(self, "_buffer", None)
        if buf is None:
            buf = self._buffer = torch.empty((len(self.steps), *x.shape), dtype=x.dtype, device=x.device)
            self._buffer_start = i
        if buf.shape[1:] != x.shape or buf.dtype != x.dtype or buf.device != x.device or i >= buf.shape[0]:
            return x.detach()
        return buf[i].copy_(x.detach())

    def times(self, t0: float, dt: float) -> torch.Tensor:
        """The recorded times t0 + k·dt, (T,) float64."""
        return torch.tensor([t0 + k * dt for k in self.steps], dtype=torch.float64)

    def stacked(self, t0: float, dt: float):
        """(times (T,) float64, x (T, ...), series {energy, slope, dissipation}, ledger, observables)."""
        r = self.records
        times = self.times(t0, dt)
        if self.diagnostics:
            ledger = {key: torch.stack(r["ledger." + key]) for key in self.ledger_keys}
            series = {key: torch.stack(r[key]) for key in ("energy", "slope", "dissipation")}
        else:
            ledger, series = {}, {"energy": None, "slope": None, "dissipation": None}
        obs = {name: torch.stack(r["obs." + name]) for name in self.observables}
        xs = r["x"]
        buf = getattr(self, "_buffer", None)
        whole = buf is not None and self._buffer_start == 0 and len(xs) == buf.shape[0] and all(
            v.data_ptr() == buf[i].data_ptr() for i, v in enumerate(xs))
        return times, (buf if whole else torch.stack(xs)), series, ledger, obs


# ---------------------------------------------------------------------------- checkpointer
def _fingerprint(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, torch.Tensor):
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
            h.update(str((tuple(p.shape), p.dtype)).encode())
        else:
            h.update(repr(p).encode())
    return h.hexdigest()[:16]


def _code_digest(code, h) -> None:
    """Feed a code object into the hash: its bytecode, names and constants (nested code objects
    recursively; their repr would carry an address)."""
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for c in code.co_consts:
        if hasattr(c, "co_code"):
            _code_digest(c, h)
        else:
            h.update(repr(c).encode())


def callable_signature(fn, what: str, tag: Optional[str] = None, depth: int = 0) -> list:
    """What defines a callable that changes the numbers of a run (a Custom drift or diffusion, an
    observable), for the checkpoint fingerprint: its qualified name, a hash of its source
    (``inspect.getsource``) and bytecode, the values its closure cells, defaults and the module
    globals it reads hold (numbers, strings, tensors; other objects by type), and ``tag`` if given.

    A callable whose source cannot be read (defined in ``python -c`` or an ``exec`` string) needs an
    explicit ``tag``: ValueError otherwise.  Built-in functions count by their qualified name.
    Globals that are objects (not numbers, strings or tensors) are seen by their type only: give a
    ``tag`` that changes with them."""
    import functools
    import inspect

    out = [f"{what}:", f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"]
    if tag is not None:
        out.append(f"tag={tag!r}")
    if depth > 3:
        return out
    if isinstance(fn, functools.partial):
        out += callable_signature(fn.func, what, None, depth + 1)
        out += [_value_signature(a, depth + 1) for a in fn.args]
        out += [(k, _value_signature(v, depth + 1)) for k, v in sorted(fn.keywords.items())]
        return out
    if inspect.isbuiltin(fn) or inspect.isroutine(fn) and not hasattr(fn, "__code__") and not inspect.ismethod(fn):
        return out  # a C function: its qualified name is its identity
    target = fn.__func__ if inspect.ismethod(fn) else fn
    if not inspect.isfunction(target):  # a callable object: its class's source and its attributes
        out += callable_signature(type(fn).__call__, what, None, depth + 1)
        out += [(k, _value_signature(v, depth + 1)) for k, v in sorted(vars(fn).items())] if hasattr(fn, "__dict__") \
            else []
        return out
    h = hashlib.sha256()
    try:
        h.update(inspect.getsource(target).encode())
    except (OSError, TypeError):
        if tag is None:
            raise ValueError(
                f"{what} ({out[1]}) has no readable source (defined in `python -c` or exec?), so a checkpoint "
                f"cannot tell it from another function of the same name: "
                + ("give the process a tag that changes with the function (Custom(..., tag='drift-v2')), "
                   if what.startswith("theta") else "")
                + "define it in a file, or run without checkpoint=") from None
    _code_digest(target.__code__, h)
    out.append(h.hexdigest()[:16])
    for cell in target.__closure__ or ():
        try:
            out.append(_value_signature(cell.cell_contents, depth + 1))
        except ValueError:  # an empty cell
            out.append("<empty cell>")
    out += [_value_signature(v, depth + 1) for v in (target.__defaults__ or ())]
    out += [(k, _value_signature(v, depth + 1)) for k, v in sorted((target.__kwdefaults__ or {}).items())]
    g = getattr(target, "__globals__", {})
    for name in target.__code__.co_names:
        if name in g and isinstance(g[name], (int, float, complex, str, bool, torch.Tensor)):
            out.append((name, _value_signature(g[name], depth + 1)))
    return out


def _value_signature(v, depth: int = 0):
    """A value in a fingerprint: tensors as they are (hashed by bytes), numbers and strings by repr, Heads by
    their tensors, containers by their items, callables by :func:`callable_signature`, other objects by type."""
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, (int, float, complex, str, bool)) or v is None:
        return repr(v)
    if isinstance(v, Heads):
        return [t for t in (v.score, v.value, v.weights, v.query, v.key) if t is not None] + [
            v.beta if isinstance(v.beta, torch.Tensor) else repr(v.beta)]
    if depth > 4:
        return type(v).__qualname__
    if isinstance(v, (list, tuple)):
        return [_value_signature(u, depth + 1) for u in v]
    if isinstance(v, dict):
        return [(repr(k), _value_signature(u, depth + 1)) for k, u in v.items()]
    if callable(v):
        return callable_signature(v, "a callable", None, depth + 1)
    return type(v).__qualname__


def process_parts(process) -> List[tuple]:
    """(label, values) for each attribute of a process (type, scheme, rates, σ, means, phases, heads and β,
    and its callables by :func:`callable_signature`), for the checkpoint fingerprint: a checkpoint of a
    run with other weights is refused, naming the attribute that differs."""
    parts = [("theta (the type of the weight process)", [type(process).__name__])]
    tag = getattr(process, "tag", None)

    def add(v, out, key, depth=0):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, Heads):
            for t in (v.score, v.value, v.weights, v.query, v.key):
                if t is not None:
                    out.append(t)
            out.append(v.beta if isinstance(v.beta, torch.Tensor) else repr(v.beta))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out.append(repr(v))
        elif isinstance(v, (list, tuple)) and depth < 2:
            for u in v:
                add(u, out, key, depth + 1)
        elif callable(v):
            out.extend(callable_signature(v, f"theta's {key.lstrip('_')}", tag))
        else:
            out.append(type(v).__name__)

    for key in sorted(vars(process)):
        vals = [key]
        add(vars(process)[key], vals, key)
        parts.append((f"theta.{key.lstrip('_')}", vals))
    return parts


def process_signature(process) -> list:
    """Everything that defines a process, flattened (:func:`process_parts` without the labels)."""
    return [v for _, vals in process_parts(process) for v in vals]


def _all_finite(o, depth=0) -> bool:
    if isinstance(o, torch.Tensor):
        return not o.is_floating_point() or bool(torch.isfinite(o).all())
    if depth > 4:
        return True
    if isinstance(o, dict):
        return all(_all_finite(v, depth + 1) for v in o.values())
    if isinstance(o, (list, tuple)):
        return all(_all_finite(v, depth + 1) for v in o)
    if isinstance(o, float):
        return o == o and abs(o) != float("inf")
    return True


class Checkpointer:
    """Atomic checkpoints of a fixed-step solve every ``every`` steps; resumes a matching file and
    refuses a foreign, corrupt, non-finite or other-run one (ValueError).  path=None: does nothing.

    ``fingerprint_parts()`` gives the run's inputs, either as a flat sequence of values or as
    (label, values) pairs; the fingerprint hashes the values in order (so the fingerprints of
    checkpoints written before the labels existed are unchanged), and each label's own digest is
    saved too, so that a mismatch names what differs."""

    KIND = "transformer_pde.simulate"

    def __init__(self, path, every: int, K: int, fingerprint_parts: Callable[[], Sequence]):
        self.path = None if path is None else check_output_file(path)  # before any step: not at the first save
        self.every, self.K = every, K
        self.fingerprint, self.labelled = None, {}
        if self.path is not None:
            parts = list(fingerprint_parts())
            if parts and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in parts):
                self.fingerprint = _fingerprint(*[v for _, vals in parts for v in vals])
                self.labelled = {label: _fingerprint(*vals) for label, vals in parts}
            else:
                self.fingerprint = _fingerprint(*parts)

    def _what_differs(self, ck) -> str:
        theirs = ck.get("fingerprint_parts")
        if not isinstance(theirs, dict) or not self.labelled:
            return "config fingerprint {} != {}".format(ck.get("fingerprint"), self.fingerprint)
        diff = [label for label in self.labelled if theirs.get(label) != self.labelled[label]]
        diff += [label for label in theirs if label not in self.labelled]
        return "these inputs differ: " + ", ".join(diff) if diff else "config fingerprint differs"

    def load(self, device) -> Optional[dict]:
        """The saved state of this run, or None when there is none."""
        if self.path is None or not self.path.exists():
            return None
        try:
            ck = torch.load(self.path, map_location=device, weights_only=False)
        except Exception as e:  # corrupt or unreadable
            raise ValueError(f"checkpoint {self.path} is corrupted or unreadable ({type(e).__name__}: {e}); "
                             f"delete it to start afresh") from None
        if not isinstance(ck, dict) or ck.get("kind") != self.KIND:
            raise ValueError(f"{self.path} is not a transformer_pde simulate checkpoint; delete it or choose another path")
        if ck.get("fingerprint") != self.fingerprint:
            raise ValueError(f"checkpoint {self.path} belongs to a different run ({self._what_differs(ck)}); "
                             f"delete it or use another path")
        # what the solver checks finite at every step: the tokens, Θ, the recorded series and the ledger sums
        # (not the observables, which may be NaN by definition, nor the scale's bookkeeping)
        records = ck.get("records") if isinstance(ck.get("records"), dict) else {}
        checked = {"x": ck.get("x"), "driver": (ck.get("driver") or {}).get("A") if isinstance(ck.get("driver"), dict)
                   else None, "acc": ck.get("acc"), "records": {k: v for k, v in records.items()
                                                                if not k.startswith("obs.")}}
        if not _all_finite(checked):
            raise ValueError(f"checkpoint {self.path} holds NaN or inf (tokens, weights, records or ledger): it cannot "
                             f"come from a finished step of this run; delete it to start afresh")
        return ck

    def after_step(self, k: int, state: Callable[[], dict]):
        """Save state() after step k when k is a multiple of ``every`` (and not the last step).

        The file is written to a fresh temporary file next to it (created exclusively: never through
        a link or into a file that is there already) and moved into place with os.replace."""
        if self.path is None or k % self.every != 0 or k >= self.K:
            return
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({"kind": self.KIND, "fingerprint": self.fingerprint, "fingerprint_parts": self.labelled,
                            "k": k, **state()}, f)
            os.replace(tmp, self.path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # the temporary file this call created
            err = write_error(self.path, e)  # a full disk: say so, not torch's "[enforce fail at ...]"
            if err is not None:
                raise err from e
            raise


# ---------------------------------------------------------------------------- progress
class _NoBar:
    def update(self, n=1):
        pass


@contextlib.contextmanager
def progress_bar(show: bool, total: int, desc: str, initial: int = 0):
    """A tqdm bar (shown on a terminal only: ``disable=None``) when ``show``, else a do-nothing bar."""
    if not show:
        yield _NoBar()
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=initial, desc=desc, unit="step", leave=False, disable=None)
    try:
        yield bar
    finally:
        bar.close()
