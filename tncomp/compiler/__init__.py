"""The torch-free stages of the compiler: IR and builders, problems and costs, search,
batch regimes, lowering to GEMM plans, the device cost model, the plan caches, and the planner
that ties them together (binding -> Tree -> Plan, and every cache key).

Nothing here imports torch (tests/tncomp/test_layering.py parses the imports), so plans are
built and tested anywhere."""
