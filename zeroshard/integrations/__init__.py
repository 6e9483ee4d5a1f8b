"""The two checkpoint routes frameworks give no other way into, one module per framework (``hf``, ``accelerate``), each
imported only when used; the core of zeroshard never imports a framework (docs/integrations.md)."""
