"""Cases from a DICOMweb server (a PACS: Orthanc, dcm4chee, a cloud DICOM store), and their results stored back into
the study they came from.

Four parts, each one job: :mod:`~scripts.inference.dicomweb.client` (the server: HTTP, authentication, retries,
diagnosis), :mod:`~scripts.inference.dicomweb.dicomjson` (reading DICOM JSON), :mod:`~scripts.inference.dicomweb.cases`
(studies to cases), :mod:`~scripts.inference.dicomweb.transforms` (retrieve and store, as MONAI transforms). The
configs name them from here.

* :class:`DicomWeb` is one server: its URL, the authentication (none, HTTP basic, or a bearer token -- the secret read
  from an environment variable or a file, never from the command line, never logged or reported), the CA bundle for
  HTTPS, and one retry policy for every request: time-outs, dropped connections and HTTP 408/429/5xx are retried with
  exponential back-off; 401, 403, 404 and the like raise a :class:`DicomWebError` at once, naming the URL and what to
  do. The client is ``dicomweb-client`` (one ``requests`` session per process).
* :func:`find_cases` turns StudyInstanceUIDs and/or a QIDO-RS query into cases, one per study, each with the CT series
  :func:`scripts.data.dicom.series_rules.choose_series` picks (the rule a folder's studies get too: an ORIGINAL axial
  series of at least 10 classic CT images first, never a scout), and writes the choice and the alternatives (each
  with why it was not chosen) into ``inference_report.json``. A study that is not found or has no usable CT series
  fails its ``check`` there; with ``store``, a study where this version's results for the chosen series are already
  stored is skipped (not inferred again) unless forced.
* :class:`RetrieveSeriesd` -- the first step of a case's loading, so the next case downloads while the network runs --
  streams the chosen series by WADO-RS into a temporary folder, one file per instance, as stored on the server; after a
  cut transfer it fetches only the instances still missing. :meth:`RetrieveSeriesd.discard` removes the folder when
  the case is done (``CaseByCaseEvaluator(on_case_done=...)``), and whatever is left goes when the process ends.
* :class:`StoreResultsd` (after ``save_case``) stores the case's DICOM SEG, RTSTRUCT and SR by STOW-RS into the source
  study, in one request, once every object has been read and checked; a transfer that fails is retried with the same
  instances (STOW-RS stores an instance once, by its SOP Instance UID), so a retry completes the set rather than
  doubling it. A store that fails for good fails the case at stage ``store`` (:class:`DicomWebStoreError`) and the
  next case runs. As an evaluator handler it adds each case's store outcome to ``inference_report.json``.
"""

from scripts.inference.dicomweb.cases import describe_series, find_cases
from scripts.inference.dicomweb.client import DicomWeb, DicomWebError, DicomWebStoreError
from scripts.inference.dicomweb.transforms import RetrieveSeriesd, StoreResultsd

__all__ = [
    "DicomWeb",
    "DicomWebError",
    "DicomWebStoreError",
    "RetrieveSeriesd",
    "StoreResultsd",
    "describe_series",
    "find_cases",
]
