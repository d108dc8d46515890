import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(params=[torch.float64, torch.float32], ids=["f64", "f32"])
def dtype(request):
    return request.param


def gen(seed=0):
    return torch.Generator().manual_seed(seed)
