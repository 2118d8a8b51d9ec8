"""Training tools around the losses: a queue of keys (:class:`~flashcl.MemoryBank`),
cached steps beyond the batch that fits (:func:`~flashcl.cached_step`), a learnable
logit scale (:class:`~flashcl.LogitScale`) and the embedding metrics
(:mod:`flashcl.metrics`)."""
