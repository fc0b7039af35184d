"""``python -m scripts.gpu_monitor watch --output_dir DIR``: sample the GPUs beside any job
(:func:`scripts.profiling.gpu_monitor.watch`)."""

import fire
from scripts.profiling.gpu_monitor import watch

if __name__ == "__main__":
    fire.Fire({"watch": watch})
