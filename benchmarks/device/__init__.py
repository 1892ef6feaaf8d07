"""The device tooling: ``python -m benchmarks.device <stage> [options]`` runs one stage of the
GPU checks and measurements on a device machine (:mod:`.cli`); one module per stage under
:mod:`.stages`, the commands' bounds and logs in :mod:`.runner`, the run record in
:mod:`.record`."""
