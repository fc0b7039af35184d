"""The bundle as a DICOM node: a planning system or PACS sends a CT by C-STORE, and the GTV goes back to the configured
nodes as an RTSTRUCT, a DICOM SEG and an SR, with nothing lost across crashes (``monai.bundle run serve``).

Three parts, each one job: :mod:`~scripts.inference.node.spool` (the queue on disk: instances, study versions, what
was inferred and sent), :mod:`~scripts.inference.node.receive` (C-ECHO and C-STORE in: who may call, TLS, the free-space
guard), :mod:`~scripts.inference.node.send` (C-STORE out, retried with back-off, recorded per destination), tied
together by :mod:`~scripts.inference.node.serve` (the loops, inference of each study by ``monai.bundle run inference``,
recovery at start). docs/inference.md "As a DICOM node" shows the flow and the settings.
"""

from scripts.inference.node.serve import serve

__all__ = ["serve"]
