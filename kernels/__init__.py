"""zeroshard.kernels: Triton kernels for the optimizer step and their eager torch references.

Installed as ``zeroshard.kernels`` (see ``pyproject.toml``), never as a top-level ``kernels``
package: that name belongs to Hugging Face's distribution, which transformers (5.25 on) requires and
imports. In a checkout, a process started there with ``python -m`` (``python -m pytest``, ``python -m
bench``) has the root on ``sys.path``, where this directory would shadow it: imported as ``kernels``,
this module runs the installed package instead (:func:`_become_shadowed`).

- :func:`fused_adamw_`: unscale x clip, Adam/AdamW moments, bias correction, weight decay, the fp32
  master update and the cast into the 16-bit param, in one pass (``kernels/adam.py``).
- :func:`grad_sumsq`: fp32 sum of squares of a gradient shard, non-finite iff it holds inf/NaN
  (``kernels/norm.py``).
- :func:`adamw_reference_`, :func:`grad_sumsq_reference`: the same in eager torch
  (``kernels/reference.py``).
"""

import sys


def _become_shadowed() -> bool:
    """Imported as top-level ``kernels`` (the checkout's root on ``sys.path``): run the ``kernels`` package found on the rest of
    ``sys.path`` in this module, whose ``__path__`` becomes that package's (its submodules load from there), and return whether
    there was one. The module object stays the one the import system made, so another thread importing ``kernels`` meanwhile
    waits for it to finish, as for any import."""
    import importlib.machinery
    import os

    here = os.path.realpath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    spec = importlib.machinery.PathFinder.find_spec(__name__, [p for p in sys.path if os.path.realpath(p or os.curdir) != root])
    if spec is None or spec.origin is None or spec.submodule_search_locations is None or os.path.realpath(spec.origin) == here:
        return False  # none installed, a module rather than a package, or this file again by another path
    code = spec.loader.get_code(__name__) if isinstance(spec.loader, importlib.machinery.SourceFileLoader) else None
    if code is None:
        return False
    globals().update(__file__=spec.origin, __path__=list(spec.submodule_search_locations))
    exec(code, globals())
    globals().update(__spec__=spec, __loader__=spec.loader)
    return True


if __name__ != "kernels" or not _become_shadowed():
    from zeroshard.kernels.adam import fused_adamw_
    from zeroshard.kernels.norm import grad_sumsq
    from zeroshard.kernels.reference import adamw_reference_, grad_sumsq_reference

    __all__ = ["adamw_reference_", "fused_adamw_", "grad_sumsq", "grad_sumsq_reference"]
