"""Tools for users' own code: ``flashcl doctor`` (a hand-written loss named, checked
and timed against its flashcl call) and the process memory readings it and the
benchmark take."""
