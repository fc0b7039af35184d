"""``python -m scripts.cross_validation run|train|evaluate ...``: k-fold cross-validation as one command
(:mod:`scripts.evaluation.cross_validation`)."""

import fire
from scripts.common.cli import command
from scripts.evaluation.cross_validation import CrossValidationError, evaluate, print_summary, run, train

if __name__ == "__main__":
    errors = (CrossValidationError, ValueError)
    fire.Fire({name: command(function, print_summary, errors=errors, name=f"cross_validation {name}")
               for name, function in (("run", run), ("train", train), ("evaluate", evaluate))})  # fmt: skip
