"""Helpers the bench scripts share, in one place: `serving` (the serving benchmarks' client,
statistics and server process), `inproc` (the native engine without HTTP) and `processes` (the
peak RSS of a process tree). A script run as a file puts the checkout first on sys.path to
import them (`python bench/serve/serve_load.py`)."""
