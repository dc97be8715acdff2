"""torch modules with rank gates: linear layers, embeddings, fused siblings, attention, CoLA
bottlenecks (``B act(A x)``, :mod:`comera.layers.cola`)."""
