"""Rank control: the size count, the objective and its regularisers, pruning and truncation."""
