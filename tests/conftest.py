import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# The suite is hundreds of small problems: with two OpenMP threads per process the thread hand-offs
# cost more than they save (measured here: the default run took ~6 min with 2 threads, ~2 min with 1).
# Speed is measured by the scripts in scripts/, never here.
torch.set_num_threads(1)


@pytest.fixture(params=[torch.float64, torch.float32], ids=["f64", "f32"])
def dtype(request):
    return request.param


def gen(seed=0):
    return torch.Generator().manual_seed(seed)
