"""The ``toposched`` command line: one module per command group, wired together in ``main``."""
