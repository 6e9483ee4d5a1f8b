"""Adapters for training frameworks, one module per framework, each imported only when used.

The core of zeroshard never imports a framework; ``zeroshard.integrations.accelerate`` and
``zeroshard.integrations.hf`` import theirs (``pip install 'zeroshard[integrations]'``).
"""
