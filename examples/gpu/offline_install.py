"""On the offline GPU machine (``examples/gpu/offline_bundle.sh``): unpack the carried wheels into SITE (file modes
kept: Ray's raylet and gcs_server must stay executable) and the repository archive into REPO, with
screl.callbacks and screl.strategies linked in where the package maps them.

    python3 install.py SITE REPO
"""

import os
import sys
import tarfile
import time
import zipfile
from pathlib import Path

here = Path(__file__).resolve().parent
site, repo = Path(sys.argv[1]), Path(sys.argv[2])
t0 = time.time()
site.mkdir(parents=True, exist_ok=True)
for whl in sorted((here / "whl").glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            path = z.extract(info, site)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
repo.mkdir(parents=True, exist_ok=True)
with tarfile.open(here / "repo.tar.gz") as t:
    t.extractall(repo)
for sub in ("callbacks", "strategies"):
    link = repo / "screl" / sub
    if not link.exists():
        link.symlink_to(repo / sub)
print(f"install: {len(list((here / 'whl').glob('*.whl')))} wheels into {site}, repo into {repo}, {time.time() - t0:.1f} s",
      flush=True)
