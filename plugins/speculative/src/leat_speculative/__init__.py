"""leat-speculative: proposers for speculative decoding (see :mod:`leat.speculative`)."""
