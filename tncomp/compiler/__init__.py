"""The torch-free stages of the compiler: IR and builders, problems and costs, search,
batch regimes, lowering to GEMM plans, the device cost model and the plan caches.

Nothing here imports torch (a test parses the imports), so plans are built and tested
anywhere."""
