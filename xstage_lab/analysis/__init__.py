"""The read side: everything that turns records into tables, fits, forecasts and summary entries,
on the CPU, one subpackage per family (``remote_store``, ``attention``, ``moe``). It imports no
benchmark (``experiments``), no kernel host code (``ops``) and no torch, CuPy or Triton; it reads
records only through ``loading``."""
