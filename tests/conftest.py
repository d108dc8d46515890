import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# The suite is hundreds of small problems: with two OpenMP threads per process the thread hand-offs
# cost more than they save (measured here: the default run took ~6 min with 2 threads, ~2 min with 1).
# Speed is measured by the scripts in scripts/, never here.  TP_TEST_THREADS=k runs the suite with k
# torch threads (CI runs it with 1 and with 2: results must not depend on the thread count).
def _test_threads() -> int:
    raw = os.environ.get("TP_TEST_THREADS", "1")
    try:
        k = int(raw)
    except ValueError:
        raise pytest.UsageError(f"TP_TEST_THREADS must be a positive integer, got {raw!r}") from None
    if not 1 <= k <= max(1, os.cpu_count() or 1) * 4:
        raise pytest.UsageError(f"TP_TEST_THREADS = {k} is outside 1..{max(1, os.cpu_count() or 1) * 4} "
                                f"(at most 4 per CPU core)")
    return k


TEST_THREADS = _test_threads()
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(params=[torch.float64, torch.float32], ids=["f64", "f32"])
def dtype(request):
    return request.param


def gen(seed=0):
    return torch.Generator().manual_seed(seed)
