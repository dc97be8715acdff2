"""Memory-lean versions of torch ops: recompute-in-backward, bool-mask dropout, attention."""
