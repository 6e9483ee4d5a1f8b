"""zeroshard.kernels: Triton kernels for the optimizer step and their eager torch references.

Installed as ``zeroshard.kernels`` (see ``pyproject.toml``), never as a top-level ``kernels``
package: that name belongs to another PyPI distribution that transformers imports.

- :func:`fused_adamw_`: unscale x clip, Adam/AdamW moments, bias correction, weight decay, the fp32
  master update and the cast into the 16-bit param, in one pass (``kernels/adam.py``).
- :func:`grad_sumsq`: fp32 sum of squares of a gradient shard, non-finite iff it holds inf/NaN
  (``kernels/norm.py``).
- :func:`adamw_reference_`, :func:`grad_sumsq_reference`: the same in eager torch
  (``kernels/reference.py``).
"""

from zeroshard.kernels.adam import fused_adamw_
from zeroshard.kernels.norm import grad_sumsq
from zeroshard.kernels.reference import adamw_reference_, grad_sumsq_reference

__all__ = ["adamw_reference_", "fused_adamw_", "grad_sumsq", "grad_sumsq_reference"]
