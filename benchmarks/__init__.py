"""Benchmark generators; `python -m benchmarks SECTION [run|report]` regenerates one BENCHMARKS.md section."""
