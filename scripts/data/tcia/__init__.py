"""Download a TCIA collection's DICOM SEG series and the CT series they annotate, from the NBIA REST API.

Input: a collection name (default ``NSCLC-Radiomics``) and the NBIA base URL.
Output (the layout of ``monai.apps.TciaDataset``, so data fetched by either tool is usable by both)::

    <dataset_dir>/<collection>/<PatientID>/<SeriesNumber>/seg/*.dcm     the SEG series
    <dataset_dir>/<collection>/<PatientID>/<SeriesNumber>/image/*.dcm   the CT series the SEG references
    <dataset_dir>/<collection>/<PatientID>/<SeriesNumber>/.complete.json  marker, written last (see below)

``PatientID`` and ``SeriesNumber`` are read from the SEG file with TciaDataset's fallbacks (PatientName, then
"patient"; AcquisitionNumber, then "0"). Files are flattened: only the base name of each ``.dcm`` zip entry is kept.
With ``--modality RTSTRUCT`` the annotation folder is ``rtstruct/``, as in TciaDataset (``seg_type.lower()``).

Modules: :mod:`~scripts.data.tcia.download` (the API: list, skip completed cases, fetch the rest in parallel),
:mod:`~scripts.data.tcia.client` (HTTP with retries and resumable transfers), :mod:`~scripts.data.tcia.archive` (zip +
MD5 checks, safe extraction), :mod:`~scripts.data.tcia.markers` (completed cases on disk, atomic installation),
:mod:`~scripts.data.tcia.references` (what an annotation series references). CLI: ``python -m scripts.tcia download``.

What we found about the API (no network here, so from documentation and NBIA's own source code):

* The default base URL is MONAI's, ``https://services.cancerimagingarchive.net/nbia-api/services/v1/`` -- the
  "NBIA Search REST API" for public collections, no token needed (TCIA wiki, "NBIA Search REST API Guide").
* NBIA's server source (github.com/CBIIT/NBIA-TCIA, ``software/nbia-api/src/gov/nih/nci/nbia/restAPI/v4/``)
  defines ``v4/getSeries``, ``v4/getImage``, ``v4/getImageWithMD5Hash`` and ``v4/getSOPInstanceUIDs`` with the same
  parameters, so ``--base_url https://services.cancerimagingarchive.net/nbia-api/services/v4/`` (or the
  ``TCIA_BASE_URL`` environment variable) should work unchanged once TCIA retires v1; whether v4 serves public
  collections without a token could not be checked from here. ``v2`` needs an OAuth token and is not supported.
* Both versions name zip entries ``00000001.dcm``, ``00000002.dcm``, ... and the MD5 endpoint appends
  ``md5hashes.csv`` with the header ``Filename,MD5Hash`` (we also accept no header, swapped or extra columns, and
  ``md5sum``-style lines). ``getImage`` adds a ``LICENSE`` entry, which is skipped with every other non-DICOM entry.
* The zip is streamed (usually without Content-Length) and a server-side error mid-stream still closes the zip
  cleanly, just without the remaining files and without ``md5hashes.csv``; so a missing manifest, or a listed file
  missing from the archive, counts as a cut transfer and is fetched again.
"""

from scripts.data.tcia.archive import MD5_MANIFEST, extract_series_zip, parse_md5_manifest
from scripts.data.tcia.client import DEFAULT_BASE_URL, list_series, resolve_base_url
from scripts.data.tcia.download import DownloadSummary, SeriesResult, download, download_for_training
from scripts.data.tcia.errors import IntegrityError, TciaError, UnsafeArchiveError
from scripts.data.tcia.markers import MARKER, STAGING
from scripts.data.tcia.references import case_key, find_referenced_series_uid, find_referenced_sop_uids

__all__ = [
    "DEFAULT_BASE_URL",
    "MARKER",
    "MD5_MANIFEST",
    "STAGING",
    "DownloadSummary",
    "IntegrityError",
    "SeriesResult",
    "TciaError",
    "UnsafeArchiveError",
    "case_key",
    "download",
    "download_for_training",
    "extract_series_zip",
    "find_referenced_series_uid",
    "find_referenced_sop_uids",
    "list_series",
    "parse_md5_manifest",
    "resolve_base_url",
]
