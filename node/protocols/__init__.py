"""Front doors: one module per wire protocol, each a thin adapter to ``node.step``."""
