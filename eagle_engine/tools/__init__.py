"""The engine's tools: the command line (`cli.py`), benchmarks and tuning (`bench.py`,
`autotune.py`), the GPU-path checks (`selfcheck.py`, `app_path.py`), the host-sync counter,
and a head's inspection and llama.cpp export. They use the engine; the engine never imports
them."""
