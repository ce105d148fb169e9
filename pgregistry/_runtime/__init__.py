"""The machinery under the public modules, private to the package: ranks agreeing on a decision and
checking in (``agreement``, ``attendance``, ``survivors``), the communicators and their process-wide
cache (``communicators``, ``group_cache``), the one door every entry point passes its model and
collection through (``resolve``), the checks of counts, flags, meta tensors and tensors sharing
memory given to the public API (``integers``, ``flags``, ``meta_tensors``, ``overlapping_tensors``),
parameter-role hooks (``role_hooks``), warning and command-line options (``warning_options``,
``empty_options``, ``exact_options``), logging (``logger``) and optional Triton kernels
(``optional_kernels``).

Nothing is imported here, so importing one of these modules loads only what it needs (``import
pgregistry`` loads no torch).
"""
