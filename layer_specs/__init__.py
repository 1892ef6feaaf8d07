"""Megatron-Core layer specs for MSA: re-exports :mod:`nemo_msa.megatron.layer_specs`."""

from nemo_msa.megatron.layer_specs import *  # noqa: F403
from nemo_msa.megatron.layer_specs import __all__  # noqa: F401
