"""zeroshard.kernels: Triton kernels for the optimizer step and their eager torch references.

Installed as ``zeroshard.kernels`` (see ``pyproject.toml``), never as a top-level ``kernels``
package: that name belongs to another PyPI distribution that transformers imports.
The fused AdamW and grad-norm kernels are not part of this release yet.
"""

__all__: list[str] = []
