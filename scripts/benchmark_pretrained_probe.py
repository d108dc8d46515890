"""Time the pretrained-network probe against the network's own forward pass, side by side.

    python scripts/benchmark_pretrained_probe.py                       # 1000 sentences, <= 64 tokens
    python scripts/benchmark_pretrained_probe.py --sentences 200 --threads 1

Runs, in one process and on the same sentences (``pydoc_data.topics``, seed 0):

1. the network's own forward (the transformers module with ``output_hidden_states``), on the probe's
   length buckets and on one batch padded to the longest sentence (best of ``--repeats``);
2. the whole ``pretrained_probe`` study (figures off) in a temporary run directory,

and prints their wall times and process CPU times, the ratio probe / forward, the probe's own breakdown
(metrics.json ``timing``: hidden states, β_eff, energy, each rung of the ladder, the distances, the
Lipschitz estimate), the torch thread count, the OpenMP wait policy and the load average before and after.
Nothing is asserted.

``OMP_WAIT_POLICY`` is set to PASSIVE unless the environment sets it (``--omp-wait-policy`` to choose):
on a machine whose cores are busy with other jobs, OpenMP workers that spin while waiting make every
parallel element-wise operation of a second thread wait for a scheduler slice (about 5 ms per operation
measured on 2 loaded cores), which penalises the probe's many small operations far more than the forward
pass's few large ones.  The policy is read when OpenMP starts, hence before torch is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _omp_policy(argv):
    """The value of --omp-wait-policy (default: the environment's, else PASSIVE), set before torch loads."""
    args = sys.argv[1:] if argv is None else list(argv)
    for i, a in enumerate(args):
        if a.startswith("--omp-wait-policy="):
            os.environ["OMP_WAIT_POLICY"] = a.split("=", 1)[1]
        elif a == "--omp-wait-policy" and i + 1 < len(args):
            os.environ["OMP_WAIT_POLICY"] = args[i + 1]
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


if __name__ == "__main__":
    _omp_policy(None)

import torch  # noqa: E402

import transformer_pde as tp  # noqa: E402
from transformer_pde.application.runs import execute  # noqa: E402
from transformer_pde.application.studies.probe import select_sentences  # noqa: E402


def _forward(net, batches, max_length, repeats):
    """(wall, CPU) seconds of the best of ``repeats`` forward passes over ``batches``."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for texts in batches:
            tp.pretrained.hidden_states(net, texts, max_length=max_length)
        best = min(best, (time.perf_counter() - t0, time.process_time() - c0))
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="repeats of the forward pass (best taken)")
    ap.add_argument("--cache", default=None, help="where the packaged MiniLM is extracted (default: a temp folder)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--omp-wait-policy", default=None, help="OMP_WAIT_POLICY (PASSIVE | ACTIVE); default: the "
                    "environment's, else PASSIVE (module docstring); read before torch loads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache).expanduser() if args.cache else Path(tmp) / "cache"
        folder = tp.pretrained.packaged_minilm(cache)
        dtype = getattr(torch, args.dtype)
        net = tp.pretrained.load(folder, dtype=dtype)
        texts = select_sentences(args.sentences, 0)
        ids = net.tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]
        order = torch.sort(torch.tensor([len(i) for i in ids]), stable=True).indices
        buckets = [[texts[i] for i in chunk.tolist()] for chunk in torch.tensor_split(order, args.buckets)]
        fwd_buckets = _forward(net, buckets, args.max_length, args.repeats)
        fwd_padded = _forward(net, [texts], args.max_length, args.repeats)
        cfg = {"kind": "pretrained_probe", "name": "bench",
               "params": {"sentences": args.sentences, "max_length": args.max_length, "buckets": args.buckets,
                          "cache_dir": str(cache), "figures": False, "dtype": args.dtype}}
        t0, c0 = time.perf_counter(), time.process_time()
        path = execute(cfg, out_dir=Path(tmp) / "runs", progress=False)
        probe = (time.perf_counter() - t0, time.process_time() - c0)
        metrics = json.loads((path / "metrics.json").read_text())
    load_after = os.getloadavg()
    tokens = sum(min(len(i), args.max_length) for i in ids)
    print(f"pretrained probe: {args.sentences} sentences, {tokens} tokens (<= {args.max_length} each), "
          f"{args.buckets} length buckets, {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} (1, 5, 15 min)")
    print(f"{'':36s}{'wall s':>9s}{'× forward':>11s}{'CPU s':>9s}{'× forward':>11s}")
    rows = [("network forward (length buckets)", fwd_buckets), ("network forward (one padded batch)", fwd_padded),
            ("probe, whole study", probe)]
    for name, (w, c) in rows:
        print(f"{name:36s}{w:9.2f}{w / fwd_buckets[0]:11.1f}{c:9.2f}{c / fwd_buckets[1]:11.1f}")
    print("probe parts (wall s, × forward wall):")
    for k, v in sorted(metrics["timing"].items()):
        print(f"  {k:34s}{v:9.2f}{v / fwd_buckets[0]:11.1f}")
    lay = metrics["layers"]
    print(f"Lipschitz estimate: {lay['lipschitz_sentences']} sentences, {lay['lipschitz_steps']} power steps, "
          f"{lay['lipschitz_unconverged']} (layer, sentence) items not within the relative tolerance")


if __name__ == "__main__":
    main()
