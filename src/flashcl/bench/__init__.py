"""flashcl's benchmarks: each case runs in a child process that reports its time
and peak memory, so that one case cannot inflate another's figure."""
