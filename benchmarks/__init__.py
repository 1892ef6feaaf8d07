"""The benchmark tooling (benchmarks/README.md). A regular package, so that ``python -m
benchmarks.device`` finds this folder's ``device`` even where an installed distribution ships a
top-level ``benchmarks`` of its own (a namespace package yields to any regular one on the path).
The scripts beside it run as files and import their parts (``layer_bench``, ``msa_bench``) from
this folder."""
