"""Multi-device scale-out on ``torch.distributed``: the tokens (queries) are sharded across ranks.

The implementation is :mod:`transformer_pde.solvers.sharded` (the solver object
``tp.ShardedEuler()`` for :func:`transformer_pde.solve`); this module keeps the public names
where they have always been (``tp.distributed.simulate_sharded`` and the rest).

Rank r holds a shard x_r (..., n_r, d) of the tokens and its share w_r of the token weights
(Σ_r Σ_i w_{r,i} = 1; None means uniform 1/N over all N tokens).  One evaluation

    1. all-gathers the keys  x = [x_0, ..., x_{R-1}] (..., N, d)  and their weights,
    2. evaluates, at the local queries only, the field of the full measure
       μ = Σ_j w_j δ_{x_j} (``tp.evaluate(x_r, heads, w_r, keys=x, key_weights=w)``),
    3. all-reduces (SUM) the partial sums Σ_{i ∈ shard} w_i (...) of E, 𝒢², 𝒟 and of the ledger
       terms ∂_tE, Itô correction and martingale increment.

Per rank: time ∝ n_r · N · H, memory O(N·d + n_r·H) plus one kernel block; communication
O(N·d) per evaluation.  Tensors stay on the input's device, so the same code runs with the
``gloo`` backend on CPU and ``nccl`` on GPUs.  Forward only (no autograd through the
collectives).  Without an initialised process group every function runs as one rank.

Launch one process per device with torchrun::

    torchrun --standalone --nproc_per_node=4 sharded_run.py

with, in the script::

    import os, torch, torch.distributed as dist, transformer_pde as tp
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else "cpu"
    x = tp.sphere.octahedral(100_000, dtype=torch.float32, device=device)   # same on every rank
    theta = tp.OrnsteinUhlenbeck(tp.Heads.random(8, 3, generator=torch.Generator().manual_seed(0),
                                                 dtype=torch.float32).to(device))
    x_local, w_local = tp.distributed.shard_tokens(x)
    traj = tp.distributed.simulate_sharded(x_local, theta, t1=1.0, dt=1e-2, paths=4, seed=0)
    if dist.get_rank() == 0:
        print(traj.energy[-1], traj.ledger["residual"][-1])

Every rank must build the same heads and use the same ``seed``: the weight process is sampled
redundantly on each rank (it is tiny), so all ranks see the same Θ_t without communication.
"""

from .sharded import distributed_evaluate, gather_tokens, rank_and_world, shard_tokens, simulate_sharded

__all__ = ["rank_and_world", "shard_tokens", "gather_tokens", "distributed_evaluate", "simulate_sharded"]
