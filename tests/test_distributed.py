"""Token-sharded evaluation and Euler stepping on torch.distributed (gloo, 2 processes here).

The sharded results must equal one process to 1e-12 in float64: the field at every token, the
global E, 𝒢², 𝒟 and every ledger term of an Euler run with noisy OU weights (and the jump
term of piecewise-constant layer weights)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_pde as tp
from transformer_pde import distributed as tpd
from transformer_pde.model.field import evaluate

TOL = dict(rtol=0.0, atol=1e-12)
N, D, H = 9, 3, 3  # 9 tokens: uneven shards 5 + 4 over two ranks


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.normalize(torch.randn(N, D, generator=g, dtype=torch.float64), dim=-1)
    w = torch.rand(N, generator=g, dtype=torch.float64)
    w = w / w.sum()
    heads = tp.Heads.random(H, D, generator=g, dtype=torch.float64)
    heads_ns = tp.Heads.random(H, D, symmetric=False, generator=g, dtype=torch.float64)
    layers = [tp.Heads.random(H, D, generator=g, dtype=torch.float64) for _ in range(3)]
    return x, w, heads, heads_ns, layers


def _runs(x, w, heads, heads_ns, layers, sharded: bool):
    """Everything the test compares, computed sharded (in a worker) or in one process."""
    out = {}
    for name, hh, ww, norm in (("uniform", heads, None, "softmax"), ("weighted", heads, w, "softmax"),
                               ("nonsym", heads_ns, w, "effective"), ("relu", heads, w, "relu")):
        if sharded:
            xl, wl = tpd.shard_tokens(x, ww)
            ev = tpd.distributed_evaluate(xl, hh, wl, normalization=norm, direction="descent", second_moment=True)
            v = tpd.gather_tokens(ev.velocity)
        else:
            ev = evaluate(x, hh, ww, normalization=norm, sign=-1.0, second_moment=True)
            v = ev.velocity
        out[name] = {"velocity": v, "energy": ev.energy, "slope": ev.slope, "dissipation": ev.dissipation}
    ou = tp.OrnsteinUhlenbeck(heads, rate=1.0, sigma=2 ** 0.5)
    lw = tp.Layerwise(layers, interpolation="constant", layer_time=0.02)
    for name, theta, ww, paths in (("ou", ou, None, 2), ("layers", lw, w, None)):
        kw = dict(t1=0.05, dt=0.01, paths=paths, seed=3, direction="descent", record_every=2, ledger=True)
        if sharded:
            xl, wl = tpd.shard_tokens(x, ww)
            tr = tpd.simulate_sharded(xl, theta, weights=wl, gather_x=True, **kw)
        else:
            tr = tp.simulate(x, theta, weights=ww, method="euler", **kw)
        out[name] = {"x": tr.x, "energy": tr.energy, "slope": tr.slope, "dissipation": tr.dissipation,
                     **{"ledger." + k: v for k, v in tr.ledger.items()}}
    return out


def _worker(rank, world, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = _runs(*_inputs(), sharded=True)
        res["rank_and_world"] = tpd.rank_and_world()
        res["local_rows"] = tpd.shard_tokens(_inputs()[0])[0].shape[0]
        with pytest.raises(ValueError, match="sum to 1 over all ranks"):
            xl, wl = tpd.shard_tokens(*_inputs()[:2])
            tpd.distributed_evaluate(xl, _inputs()[2], 2 * wl)
        if rank == 0:
            torch.save(res, result_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _compare(got, ref):
    for run, fields in ref.items():
        for key, val in fields.items():
            if val is None:
                assert got[run][key] is None
                continue
            torch.testing.assert_close(got[run][key], val, **TOL, msg=lambda m: f"{run}/{key}: {m}")


def test_two_gloo_processes_equal_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        init_file, result_file = os.path.join(tmp, "init"), os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(2, init_file, result_file), nprocs=2, join=True)
        got = torch.load(result_file, weights_only=False)
    assert got.pop("rank_and_world") == (0, 2)
    assert got.pop("local_rows") == 5
    _compare(got, _runs(*_inputs(), sharded=False))


def test_single_rank_without_process_group_equals_simulate():
    assert tpd.rank_and_world() == (0, 1)
    _compare(_runs(*_inputs(), sharded=True), _runs(*_inputs(), sharded=False))


def test_bad_input_is_refused():
    x, w, heads, _, _ = _inputs()
    with pytest.raises(ValueError, match="sum to 1 over all ranks"):
        tpd.distributed_evaluate(x, heads, w * 0.5)
    with pytest.raises(ValueError, match="weights must have shape"):
        tpd.distributed_evaluate(x, heads, w[:-1] / w[:-1].sum())
    with pytest.raises(TypeError, match="theta must be a Heads or a Process"):
        tpd.simulate_sharded(x, "heads", t1=0.1, dt=0.01)
    with pytest.raises(ValueError, match="not on the unit sphere"):
        tpd.distributed_evaluate(2 * x, heads)
    with pytest.raises(ValueError, match="unknown normalization"):
        tpd.distributed_evaluate(x, heads, normalization="sparsemax")
    with pytest.raises(ValueError, match="whole number of steps"):
        tpd.simulate_sharded(x, heads, t1=0.1, dt=0.03)


class _Stop(Exception):
    pass


def _sharded_interrupted_then_resumed(x, theta, path, kw):
    """The sharded run stopped by its callback after step 3 (checkpoint at step 2), then resumed from its
    checkpoint; the callback's steps of both runs."""
    seen = []

    def stop(k, t, xk):
        seen.append(k)
        if k == 3:
            raise _Stop
    xl, _ = tpd.shard_tokens(x)
    model = tp.Model(theta, direction="descent")
    with pytest.raises(_Stop):
        tp.solve(model, xl, tp.ShardedEuler(gather_x=True), checkpoint=tp.Checkpointing(path, every=2),
                 progress=tp.Progress(callback=stop), **kw)
    resumed = tp.solve(model, xl, tp.ShardedEuler(gather_x=True), checkpoint=tp.Checkpointing(path, every=2),
                       progress=tp.Progress(callback=lambda k, t, xk: seen.append(k)), **kw)
    return resumed, seen


def _resume_worker(rank, world, init_file, result_file, ck_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        x, _, heads, _, _ = _inputs()
        kw = dict(t1=0.06, dt=0.01, paths=2, seed=3, ledger=tp.LedgerOptions(ledger=True))
        traj, seen = _sharded_interrupted_then_resumed(x, tp.OrnsteinUhlenbeck(heads, sigma=1.0), ck_file, kw)
        if rank == 0:
            torch.save({"x": traj.x, "ledger": traj.ledger, "seen": seen}, result_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_callbacks_and_checkpoints_resume_the_uninterrupted_run(world, tmp_path):
    """The sharded solver runs through the loop: the callback sees every step, a run stopped after step 3
    resumes from its step-2 checkpoint (one file per rank with two ranks) and ends where the uninterrupted
    one-process Euler run ends, ledger included, to rounding."""
    x, _, heads, _, _ = _inputs()
    theta = tp.OrnsteinUhlenbeck(heads, sigma=1.0)
    kw = dict(t1=0.06, dt=0.01, paths=2, seed=3, ledger=tp.LedgerOptions(ledger=True))
    if world == 1:
        traj, seen = _sharded_interrupted_then_resumed(x, theta, tmp_path / "ck.pt", kw)
        files = ["ck.pt"]
    else:
        result = tmp_path / "result.pt"
        mp.spawn(_resume_worker, args=(2, str(tmp_path / "init"), str(result), str(tmp_path / "ck.pt")), nprocs=2,
                 join=True)
        got = torch.load(result, weights_only=False)
        traj, seen = _saved(got), got["seen"]
        files = ["ck.rank0.pt", "ck.rank1.pt"]
    assert seen == [1, 2, 3, 3, 4, 5, 6]
    assert sorted(p.name for p in tmp_path.glob("ck*.pt")) == files
    ref = tp.solve(tp.Model(theta, direction="descent"), x, tp.Euler(), **kw)
    torch.testing.assert_close(traj.x, ref.x, **TOL)
    for key, v in ref.ledger.items():
        torch.testing.assert_close(traj.ledger[key], v, **TOL, msg=lambda m: f"{key}: {m}")


def _saved(d):
    """The dict a worker saved, with attribute access (x, ledger)."""
    return type("Saved", (), d)
