"""Regenerate protocol/base/swarmloco_wire_pb2.py from protocol/base/swarmloco_wire.proto with grpcio-tools' protoc."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "protocol" / "base"


def generate(out_dir: Path) -> Path:
    from grpc_tools import protoc

    code = protoc.main(
        ["protoc", f"-I{BASE}", f"--python_out={out_dir}", str(BASE / "swarmloco_wire.proto")]
    )
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")
    return out_dir / "swarmloco_wire_pb2.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=BASE, help="where to write swarmloco_wire_pb2.py")
    args = parser.parse_args(argv)
    print(generate(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
