"""``tp.nn``: transformer pieces for training research.

The converters of real ``torch.nn`` attention layers into heads Θ_t
(:mod:`transformer_pde.processes.nn`: :func:`layerwise_from_transformer`, :func:`attention_matrix`, :func:`residual_attention_step`,
:func:`attention_modules`), the continuous-depth attention module
:class:`~transformer_pde.nn.modules.MeanFieldAttention`, whose forward is a solve, and
:class:`~transformer_pde.nn.modules.TransformerFlow`, the same flow of a torch model's own attention
layers, their heads read again in every forward.
"""

from ..processes.nn import (
    attention_matrix, attention_modules, layerwise_from_transformer, residual_attention_step,
)
from .modules import MeanFieldAttention, TransformerFlow

__all__ = ["MeanFieldAttention", "TransformerFlow", "layerwise_from_transformer", "attention_modules",
           "attention_matrix", "residual_attention_step"]
