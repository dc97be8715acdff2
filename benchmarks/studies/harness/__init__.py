"""The one study harness: every training study trains its models through the engine
(:func:`comera.experiments.engine.train_model`), names its methods by layer kind, and writes its
results the same way. A study is a thin script over it (``python -m benchmarks.studies.<name>``).

- :mod:`.runs`: one model through the engine, and its row (scores, sizes, ranks, curves);
- :mod:`.methods`: the methods, by layer kind (dense, any format at a uniform rank within a
  target, a narrower dense model of the same size or dense at given widths, CoMERA on TT or on
  any format with ranks to prune, the spectrum allocation);
- :mod:`.results`: runs files, the learning rate each method takes from the shared grid, tables
  and plots;
- :mod:`.frontier`: the compression frontier of the language-model tasks;
- :mod:`.reviews`: the reviews task at the studies' size and its shared flags.
"""
