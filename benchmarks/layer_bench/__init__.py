"""Parts of benchmarks/bench_layer.py, one job each: the model shape, its cases and the one-layer
GPTModel (:mod:`.model`), timing, memory and the profiler (:mod:`.timing`), the timed work of
each row (:mod:`.steps`), the ``--tokens`` rows (:mod:`.rows`), the MSA rows' selections and
their captured core-attention call (:mod:`.selection`), the attention work in (query, key)
pairs and the MSA rows' pair rate against cuDNN (:mod:`.pairs`) and the printed table and JSON
(:mod:`.report`)."""
