"""``screl export SOURCE --out DIR [--dtype bf16|fp32] [--adapter]``: a run's trained model as a Hugging Face folder.

SOURCE is a run's checkpoint root (``checkpointing.checkpoint_dir``: its newest complete bundle) or one bundle
(``.../step_<n>``), a local path or any URL the checkpoint store reads (``s3://bucket/prefix``). A LoRA run's bundle
exports its merged policy (base + scale * B @ A), or with ``--adapter`` the adapters alone as a PEFT adapter folder.
See docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from screl.checkpoint.resume import LIGHTNING_CKPT
from screl.export.hf_folder import write_adapter_folder, write_hf_folder
from screl.export.record import ExportError
from screl.export.source import read_bundle
from screl.models.lora import RECORD as LORA_RECORD

__all__ = ["export_bundle", "main"]


def export_bundle(source: str, out_dir: str, *, dtype: str = "bf16", config: str | None = None,
                  storage_options: Mapping[str, Any] | None = None, max_shard_size: str | int = "5GB",
                  adapter: bool = False) -> str:
    """Export the bundle ``source`` names to ``out_dir`` (see the module docstring); returns ``out_dir``. Read-only
    on the bundle, which is checked against its manifest first; :class:`ExportError` says what stopped it.
    ``adapter``: a LoRA bundle's adapters alone, as a PEFT adapter folder (refused for any other bundle)."""
    found = read_bundle(source, storage_options, config)
    provenance: dict[str, Any] = {"source": found.url, "step": found.step, "layout": found.layout}
    if adapter:
        if found.lora is None:
            raise ExportError(f"--adapter: {found.url} is not a LoRA run's bundle (its {LIGHTNING_CKPT} has no "
                              f"{LORA_RECORD!r} record: it holds the full policy). Export it without --adapter")
        settings, adapters = found.lora
        return write_adapter_folder(found.record, settings, adapters, out_dir, dtype=dtype, provenance=provenance)
    if found.lora is not None:
        provenance["form"] = "merged"
        provenance["lora"] = found.lora[0].to_json()
    return write_hf_folder(found.record, found.policy, out_dir, dtype=dtype, critic=found.critic,
                           max_shard_size=max_shard_size, provenance=provenance)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="screl export", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("source", metavar="SOURCE", help="checkpoint root (its newest bundle) or one bundle (.../step_<n>)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, empty or an earlier export)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights' dtype (default: bf16)")
    p.add_argument("--config", default=None, metavar="CONFIG_YAML",
                   help="the run's config.yaml, for a bundle of a run without the HFExport callback")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run's bundle: write its adapters alone as a PEFT adapter folder (default: merged)")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this size (default: 5GB)")
    p.add_argument("--storage-options", default=None, metavar="JSON",
                   help='fsspec options of SOURCE, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'')
    return p


def main(argv: Sequence[str]) -> int:
    """``screl export``'s entry point: 0 once the folder is written, 1 with the reason on stderr otherwise."""
    args = _parser().parse_args(list(argv))
    try:
        options = json.loads(args.storage_options) if args.storage_options else None
        if options is not None and not isinstance(options, dict):
            raise ExportError(f"--storage-options {args.storage_options}: expected a JSON object")
        out = export_bundle(args.source, args.out, dtype=args.dtype, config=args.config, storage_options=options,
                            max_shard_size=args.max_shard_size, adapter=args.adapter)
    except (ExportError, json.JSONDecodeError) as err:
        print(f"screl export: error: {err}", file=sys.stderr)
        return 1
    print(f"screl export: wrote {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
