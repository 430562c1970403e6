"""Regenerate the committed gRPC stubs in services/v1 (imported as pdserve.v1) from protos/.

    python tools/gen_protos.py            # rewrite services/v1
    python tools/gen_protos.py --check    # exit 1 if the committed stubs differ from the protos
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
STUB_DIR = ROOT / "services" / "v1"


def generate(out_root: Path) -> Path:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pdserve" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--grpc_python_out={out_root}", f"--pyi_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = out_root / "pdserve" / "v1"
    (out / "__init__.py").write_text('"""Generated gRPC stubs for the pdserve.v1 protos (tools/gen_protos.py)."""\n')
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        names = sorted(p.name for p in fresh.iterdir() if p.is_file())
        if args.check:
            committed = sorted(p.name for p in STUB_DIR.glob("*") if p.is_file()) if STUB_DIR.exists() else []
            stale = [n for n in names if n not in committed or not filecmp.cmp(fresh / n, STUB_DIR / n, shallow=False)]
            extra = [n for n in committed if n not in names]
            if stale or extra:
                print(f"stubs in {STUB_DIR} drifted from {PROTO_ROOT}: {stale + extra}; run tools/gen_protos.py")
                return 1
            print("stubs up to date")
            return 0
        if STUB_DIR.exists():
            shutil.rmtree(STUB_DIR)
        shutil.copytree(fresh, STUB_DIR)
        print(f"wrote {len(names)} files to {STUB_DIR}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
