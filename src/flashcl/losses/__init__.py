"""The loss families, one module each: every loss is one body that forms its anchor
rows, its column source (:mod:`flashcl.parallel`) and its configuration of the core
(:class:`flashcl.core.CoreSpec`), and hands them to :mod:`flashcl.runner`."""
