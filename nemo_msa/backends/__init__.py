"""The MSA backends: the registry, the backend record, the capability records, one module each.

- :mod:`nemo_msa.backends.registry`: ``resolve_backend`` and the other lookups (ADR 0002);
- :mod:`nemo_msa.backends.spec`: ``MSABackend``, what a backend is;
- :mod:`nemo_msa.backends.capabilities`: what each backend and its helper kernels run, as data
  (ADR 0019);
- :mod:`nemo_msa.backends.reference`, :mod:`nemo_msa.backends.triton`,
  :mod:`nemo_msa.backends.flashinfer`: the backends (the kernel ones load on first request).

This ``__init__`` re-exports nothing: the capability records sit below the kernels that read
them (ADR 0017's layout layer), and importing them must not run the registry, which imports
the references. The public names are ``nemo_msa``'s (``resolve_backend``, ``MSABackend``, ...).
docs/backends.md, "Adding a backend", says which files a new backend writes.
"""
