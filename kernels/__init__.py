"""zeroshard.kernels: Triton kernels for the optimizer step and their eager torch references.

Installed as ``zeroshard.kernels`` (see ``pyproject.toml``), never as a top-level ``kernels``
package: that name belongs to Hugging Face's distribution, which transformers (5.25 on) requires and
imports. In a checkout, a process started there with ``python -m`` (``python -m pytest``, ``python -m
bench``) has the root on ``sys.path``, where this directory would shadow it: imported as ``kernels``,
this module loads the installed package in its place (:func:`_load_shadowed`).

- :func:`fused_adamw_`: unscale x clip, Adam/AdamW moments, bias correction, weight decay, the fp32
  master update and the cast into the 16-bit param, in one pass (``kernels/adam.py``).
- :func:`grad_sumsq`: fp32 sum of squares of a gradient shard, non-finite iff it holds inf/NaN
  (``kernels/norm.py``).
- :func:`adamw_reference_`, :func:`grad_sumsq_reference`: the same in eager torch
  (``kernels/reference.py``).
"""

import sys


def _load_shadowed() -> bool:
    """Imported as top-level ``kernels`` (the checkout's root on ``sys.path``): put the ``kernels`` package found on the rest of
    ``sys.path`` in ``sys.modules`` in this module's place, which the import then returns; whether there was one."""
    import importlib.machinery
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.machinery.PathFinder.find_spec(__name__, [p for p in sys.path if os.path.abspath(p or os.curdir) != root])
    if spec is None or spec.loader is None:
        return False
    this, module = sys.modules[__name__], importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules[__name__] = this
        raise
    return True


if __name__ != "kernels" or not _load_shadowed():
    from zeroshard.kernels.adam import fused_adamw_
    from zeroshard.kernels.norm import grad_sumsq
    from zeroshard.kernels.reference import adamw_reference_, grad_sumsq_reference

__all__ = ["adamw_reference_", "fused_adamw_", "grad_sumsq", "grad_sumsq_reference"]
