"""Parts of benchmarks/bench_layer.py, one job each: the model shape, its cases and the one-layer
GPTModel (:mod:`.model`), timing, memory and the profiler (:mod:`.timing`), the timed work of
each row (:mod:`.steps`), the ``--tokens`` rows (:mod:`.rows`) and the printed table and JSON
(:mod:`.report`)."""
