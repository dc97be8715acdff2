"""How a weight is factored: the format protocol and registry, layouts, mode factorisation, and
the formats (TT, TT-matrix, Tucker, CP, low-rank, tensor ring, block TT, declared einsum
networks)."""
