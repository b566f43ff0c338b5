"""Regenerates the KV transfer service's Python code from `protos/`.

Run `python -m pdserve.kv.proto.generate` from a source checkout after editing a .proto file, and
commit the result: the generated files in this package are never edited by hand, and a unit test
fails when they are stale. Needs `grpcio-tools` (a development dependency, not a runtime one).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_ROOT = PACKAGE_DIR.parents[2] / "protos"
# Each entry: a .proto path below PROTO_ROOT; its generated modules land flat in this package.
PROTO_FILES = ("pdserve/kv/v1/kv_transfer.proto",)
# protoc writes `from pdserve.kv.v1 import x_pb2`; the modules live here, so import them relatively.
_ABSOLUTE_IMPORT = re.compile(r"^from pdserve\.kv\.v1 import (\w+_pb2) as", re.MULTILINE)


def generated_names(proto_file: str) -> list[str]:
    """File names generated for one .proto; called by `generate` and the staleness test."""
    stem = Path(proto_file).stem
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc for every file in PROTO_FILES and writes the modules into `out_dir`.

    Called by `main` (a developer, after editing a .proto) and by the staleness test. Blocks on
    the protoc subprocess (well under a second). Raises RuntimeError when protoc fails.
    """
    from grpc_tools import protoc  # a development dependency: imported only here

    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        for proto_file in PROTO_FILES:
            args = [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                str(PROTO_ROOT / proto_file),
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto_file}")
            generated_dir = Path(tmp) / Path(proto_file).parent
            for name in generated_names(proto_file):
                text = (generated_dir / name).read_text()
                target = out_dir / name
                target.write_text(_ABSOLUTE_IMPORT.sub(r"from . import \1 as", text))
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: `python -m pdserve.kv.proto.generate [--out DIR]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PACKAGE_DIR, help="target folder (default: this package)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
