"""How a weight is factored: mode factorisation and the TT / TT-matrix decompositions."""
