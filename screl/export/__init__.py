"""Take the trained model out: a checkpoint bundle (``screl export``) or the live module (``HFExport``) as a folder
that ``transformers`` and vLLM load as it is. See docs/export.md."""

from screl.export.cli import export_bundle, main
from screl.export.hf_folder import write_hf_folder
from screl.export.record import ExportError, export_record, record_from_config

__all__ = ["ExportError", "export_bundle", "export_record", "main", "record_from_config", "write_hf_folder"]
