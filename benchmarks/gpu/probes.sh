# The two GPU probes of 2026-11-28 (benchmarks/results/h100/{compile_probe,sync_ab}.md), as one
# device call from the repository root. Needs .whl/ (benchmarks/gpu/wheels.sh) and .old/, the
# code before the host-read batching:
#     git archive c390d99 comera tncomp benchmarks/gpu benchmarks/lib benchmarks/speed \
#         benchmarks/__init__.py | tar -x -C .old
# Writes its logs to $OUT/probes.tgz (or /tmp/probes.tgz without $OUT).
set -o pipefail; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
R=/tmp/o; mkdir -p $R; nvidia-smi > $R/nvidia-smi.txt 2>&1
export TORCHINDUCTOR_COMPILE_THREADS=3
# compile set-ups: all at once, each in its own process (correctness, not timing)
for v in base mark notrees eagerinit default; do
  PYTHONPATH=/tmp/site:$PWD timeout 230 python3 -m benchmarks.gpu.probe_compile $v cuda \
      > $R/probe_$v.log 2>&1 &
done
wait
# the eager step before/after: one process per code tree, alternating, nothing else running
for k in 1 2; do for tag in old new; do
  if [ $tag = old ]; then P=/tmp/site:$PWD/.old; else P=/tmp/site:$PWD; fi
  PYTHONPATH=$P timeout 90 python3 -m benchmarks.gpu.probe_eager_step $tag$k cuda > $R/ab_$tag$k.log 2>&1
done; done
tar czf ${OUT:-/tmp}/probes.tgz -C /tmp o
