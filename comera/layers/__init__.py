"""torch modules with rank gates: linear layers, embeddings, fused siblings, attention."""
