"""Adapters for training frameworks, one module per framework, each imported only when used.

The core of zeroshard never imports a framework; ``zeroshard.integrations.accelerate``,
``zeroshard.integrations.hf`` and ``zeroshard.integrations.lightning`` import theirs (``pip install 'zeroshard[integrations]'``).
"""
