"""``python -m scripts.synthetic --output_dir DIR [--num_cases N]``: synthetic NSCLC-like cases as DICOM in the TCIA
layout (:func:`scripts.data.synthetic.generate`)."""

import fire
from scripts.data.synthetic import generate

if __name__ == "__main__":
    fire.Fire(generate)
