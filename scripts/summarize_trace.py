"""``python -m scripts.summarize_trace TRACE [--format text|json]``: a profiler trace summarised in one streaming pass
(:mod:`scripts.profiling.summarize_trace`, which also runs alone, copied anywhere)."""

from scripts.profiling.summarize_trace import cli

if __name__ == "__main__":
    cli()
