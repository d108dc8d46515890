"""Multi-device scale-out on ``torch.distributed``: the tokens (queries) are sharded across ranks.

``tp.distributed`` is the public home of the sharded solver's functions (``shard_tokens``,
``gather_tokens``, ``rank_and_world``, ``distributed_evaluate``, ``simulate_sharded``); their
implementation, the launch recipe (``torchrun``) and the cost model are documented in
:mod:`transformer_pde.solvers.sharded` (the solver object ``tp.ShardedEuler()`` for
:func:`transformer_pde.solve`) and docs/scaling.md.
"""

from .sharded import distributed_evaluate, gather_tokens, rank_and_world, shard_tokens, simulate_sharded

__all__ = ["rank_and_world", "shard_tokens", "gather_tokens", "distributed_evaluate", "simulate_sharded"]
