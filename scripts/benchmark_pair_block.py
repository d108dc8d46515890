"""The one-block kernel of small n (transformer_pde.model.pair_block), measured side by side in one run.

Two tables of paired CPU-time ratios (median of ``--repeats`` pairs [range], interleaved, one torch thread,
float64):

1. **the field alone** — ``evaluate(x, heads, diagnostics=False)`` through the block
   (``pair_block.pair_field``) against the same call with the block switched off (``MAX_TOKENS = 0``: the
   log-sum-exp kernels), for n = 16 … 1024 tokens (8192 tokens in all, d = 16, H = 4 shared non-symmetric
   heads), without and with causal attention: where the crossover ``MAX_TOKENS`` lies for the field;
2. **what one diagnostics evaluation costs** on the peers' post-LN workload (256 systems × 32 tokens,
   d = 16, H = 8 per-system non-symmetric heads), against one call of the layer maps' fused field pass
   (``FusedUpdate``): the fused pass itself written as a loop over the same blocks (the baseline of the
   floor), that loop plus the row term Σ_h ½ω_h A_h m_h ȳ_h of ∇δE/δμ (one (n, H·d) × (H·d, d) product per
   system), plus the column term Eᵀ Y (one (n, n·H) × (n·H, d) product) — the arithmetic floor of an exact
   𝒟 for non-symmetric heads —, then ``pair_diagnostics`` without and with the ledger's token moment;
3. **a tokens-only solve** (the causal and the projected non-symmetric paths of
   scripts/benchmark_diagnostics.py: 64 systems × 32 tokens, d = 16, H = 4, 20 Euler steps) with the block's
   field against the same solve with the block switched off.

    python scripts/benchmark_pair_block.py
    python scripts/benchmark_pair_block.py --repeats 7 --sizes 32 128 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import transformer_pde as tp  # noqa: E402
from transformer_pde.model import pair_block  # noqa: E402
from transformer_pde.model.field import evaluate  # noqa: E402
from transformer_pde.dynamics.layernorm import FusedUpdate  # noqa: E402
from transformer_pde.utils import hardware  # noqa: E402

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def cpu_time(fn, calls):
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls


def paired(base, variants, repeats, calls):
    """{name: [ratio per pair]}: each variant timed right after the baseline, interleaved."""
    base()
    for fn in variants.values():
        fn()
    out = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            tb = cpu_time(base, calls)
            out[k].append(cpu_time(fn, calls) / tb)
    return out


def show(label, ratios):
    r = list(ratios)
    print(f"  {label:58s} {statistics.median(r):5.2f}  [{min(r):.2f}, {max(r):.2f}]")


def field_alone(sizes, repeats):
    print("\n1. the field alone: evaluate(diagnostics=False) through the block / the log-sum-exp kernels")
    d, H = 16, 4
    A = torch.randn(H, d, d, generator=_gen(6), dtype=F64) / d ** 0.5
    heads = tp.Heads(A, torch.randn(H, d, d, generator=_gen(7), dtype=F64) / d ** 0.5)
    for causal in (False, True):
        for n in sizes:
            x = tp.sphere.sample_uniform(n, d, batch_shape=(max(1, 8192 // n),), generator=_gen(5), dtype=F64)
            kw = {"causal": True} if causal else {}

            def lse():
                saved, pair_block.MAX_TOKENS = pair_block.MAX_TOKENS, 0
                try:
                    return evaluate(x, heads, None, diagnostics=False, **kw)
                finally:
                    pair_block.MAX_TOKENS = saved

            def block():
                return pair_block.pair_field(x, heads, None, causal=causal)
            show(f"{'causal' if causal else 'whole measure'}, n = {n}",
                 paired(lse, {"block": block}, repeats, 5)["block"])


def ladder(repeats):
    print("\n2. one diagnostics evaluation on the post-LN workload (256 x 32, d = 16, H = 8) / one FusedUpdate call")
    B, n, d, H = 256, 32, 16, 8
    x = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=_gen(2), dtype=F64)
    A = torch.randn(B, H, d, d, generator=_gen(3), dtype=F64) / d ** 0.5
    V = torch.randn(B, H, d, d, generator=_gen(4), dtype=F64) / d ** 0.5
    heads = tp.Heads(A, V)
    fused = FusedUpdate(None, 1.0)
    om = heads.weights
    qa = A.movedim(-3, -2).reshape(B, d, H * d).contiguous()
    ga = (0.5 * om[..., None, None] * A.transpose(-1, -2)).reshape(B, H * d, d).contiguous()
    vs = (om[..., None, None] * V.transpose(-1, -2)).reshape(B, H * d, d).contiguous()
    size = max(1, pair_block.block_bytes(x.device) // (n * H * n * 8))
    bufs = [torch.empty(size, *s, dtype=F64) for s in ((n, H * d), (n * H, n), (n * H, 1), (n * H, d))]
    f, g = torch.empty(B, n, d, dtype=F64), torch.empty(B, n, d, dtype=F64)

    def loop(extra):
        def run():
            Q, E, m, r = bufs
            for s in range(0, B, size):
                b = min(size, B - s)
                Qb, Eb, mb, rb = Q[:b], E[:b], m[:b], r[:b]
                xb = x[s:s + b]
                torch.bmm(xb, qa[s:s + b], out=Qb)
                torch.bmm(Qb.view(b, n * H, d), xb.transpose(1, 2), out=Eb)
                Eb.exp_()
                torch.sum(Eb, -1, keepdim=True, out=mb)
                torch.bmm(Eb, xb, out=rb)
                if extra >= 1:  # the row term of ∇δE/δμ
                    torch.bmm(rb.view(b, n, H * d), ga[s:s + b], out=g[s:s + b])
                if extra >= 2:  # the column term Eᵀ Y
                    g[s:s + b].baddbmm_(Eb.transpose(1, 2), Qb.view(b, n * H, d), alpha=0.5 / n)
                rb.div_(mb)
                torch.bmm(rb.view(b, n, H * d), vs[s:s + b], out=f[s:s + b])
        return run

    variants = {
        "the fused pass as a block loop (the floor's baseline)": loop(0),
        "  + the row term of ∇δE/δμ": loop(1),
        "  + the column term (the floor of an exact 𝒟)": loop(2),
        "pair_diagnostics without the token moment": lambda: pair_block.pair_diagnostics(x, heads, None,
                                                                                         token_moment=False),
        "pair_diagnostics with the ledger's token moment": lambda: pair_block.pair_diagnostics(x, heads, None),
    }
    for k, r in paired(lambda: fused(x, heads), variants, repeats, 10).items():
        show(k, r)


def solves(repeats):
    print("\n3. a tokens-only solve (64 x 32, d = 16, H = 4, 20 Euler steps): with the block's field / without")
    B, n, d, H = 64, 32, 16, 4
    x0 = tp.sphere.sample_uniform(n, d, batch_shape=(B,), generator=_gen(5), dtype=F64)
    A = torch.randn(H, d, d, generator=_gen(6), dtype=F64) / d ** 0.5
    heads = tp.Heads(A, A.transpose(-1, -2) @ A)
    for causal in (True, False):
        model = tp.Model(heads, causal=causal, direction="ascent")

        def run():
            return tp.solve(model, x0, tp.Euler(), t1=1.0, dt=0.05, progress=False,
                            ledger=tp.LedgerOptions(diagnostics=False)).x

        def without():
            saved, pair_block.MAX_TOKENS = pair_block.MAX_TOKENS, 0
            try:
                return run()
            finally:
                pair_block.MAX_TOKENS = saved
        show("causal" if causal else "whole measure", paired(without, {"block": run}, repeats, 2)["block"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{hardware.cpu_model()}, {os.cpu_count()} CPUs, L2 {hardware.cache_sizes().l2 // 1024} KiB; torch "
          f"{torch.__version__}, {args.threads} thread(s); load average {os.getloadavg()[0]:.2f}; "
          f"median of {args.repeats} paired CPU-time ratios [range]")
    field_alone(args.sizes, args.repeats)
    ladder(args.repeats)
    solves(args.repeats)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
