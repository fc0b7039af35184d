"""``python -m scripts.prepare --dataset_dir DIR --output_dir OUT``: DICOM cases to NIfTI once, a split and a report of
bad cases (:mod:`scripts.data.prepare`); exits with status 1 when the settings or the data are wrong."""

import fire
from scripts.common.cli import command
from scripts.data.prepare import PrepareError, prepare, print_report

if __name__ == "__main__":
    fire.Fire(command(prepare, print_report, errors=(PrepareError, ValueError), name="prepare"))
