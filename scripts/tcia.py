"""``python -m scripts.tcia download --dataset_dir DIR [--limit N] [--base_url URL] ...`` (see
:func:`scripts.data.tcia.download`); prints a summary and exits with status 1 when any series failed."""

from __future__ import annotations

import fire
from scripts.common.cli import command
from scripts.data.tcia import DownloadSummary, TciaError, download


def _report(summary: DownloadSummary) -> int:
    print(summary.format())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    fire.Fire({"download": command(download, _report, errors=(TciaError, ValueError), name="tcia")})
