"""Helpers the bench scripts share, in one place: `serving` (the serving benchmarks' client,
statistics and server process) and `inproc` (the native engine without HTTP). A script run as
a file puts the checkout first on sys.path to import them (`python bench/serve/serve_load.py`)."""
