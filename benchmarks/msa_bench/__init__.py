"""Parts of benchmarks/bench_msa.py, one job each: the cases and their inputs (:mod:`.cases`),
timing and memory on the GPU (:mod:`.timing`), the launch-parameter sweep (:mod:`.sweep`) and
the printed table (:mod:`.report`). The float64 checks are nemo_msa.testing.oracle's."""
