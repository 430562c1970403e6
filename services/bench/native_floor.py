"""The native floor router (csrc/router_floor.cc): built on first use, cached by its sources.

`pdserve bench router --floor` runs it beside the Python floors: the same calls and
messages on C++ gRPC's callback API, so the gap between the two is what Python costs and
what is left is what any router data plane pays here. Building needs the repository's
protos/ (a source checkout), protoc with gRPC's C++ plugin, and libgrpc++ (Debian:
`apt-get install libgrpc++-dev protobuf-compiler-grpc pkg-config`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pdserve.common.native import compile_objects, kernels_dir

SOURCE = Path(__file__).with_name("csrc") / "router_floor.cc"
HEALTH = SOURCE.with_name("health.proto")  # grpc.health.v1 Check, served on the same queue
PROTOS = ("common", "decode", "prefill", "router")
NEEDS = "Debian: apt-get install libgrpc++-dev protobuf-compiler-grpc pkg-config"


def proto_root() -> Path:
    """The repository's protos/ folder (its .proto files are not installed with the package)."""
    return Path(__file__).resolve().parents[2] / "protos"


def _protos() -> list[Path]:
    return [proto_root() / "pdserve" / "v1" / f"{name}.proto" for name in PROTOS]


def _sources() -> list[Path]:
    return [SOURCE, HEALTH, *_protos()]


def binary_name() -> str:
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(path.read_bytes())
    return f"router_floor-{digest.hexdigest()[:16]}"


def binary() -> Path:
    """The built floor router (built now if it is not cached); RuntimeError naming what is
    missing when it cannot be built here."""
    missing = [p for p in _sources() if not p.is_file()]
    if missing:
        raise RuntimeError(f"native floor: {missing[0]} not found (needs a source checkout)")
    target = kernels_dir() / binary_name()
    if target.is_file():
        return target
    protoc, plugin, cxx = (shutil.which("protoc"), shutil.which("grpc_cpp_plugin"),
                           os.environ.get("CXX") or shutil.which("g++"))
    if not (protoc and plugin and cxx and shutil.which("pkg-config")):
        raise RuntimeError(f"native floor: protoc, grpc_cpp_plugin, g++ and pkg-config are "
                           f"needed to build it ({NEEDS})")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".floor-", dir=target.parent) as tmp:
        out = Path(tmp)
        for root, files in ((proto_root(), _protos()), (HEALTH.parent, [HEALTH])):
            _run([protoc, f"-I{root}", f"--cpp_out={out}", f"--grpc_out={out}",
                  f"--plugin=protoc-gen-grpc={plugin}", *map(str, files)])
        packages = ["grpc++", "protobuf", "absl_synchronization"]
        cflags = ["-O2", "-std=c++17", f"-I{out}",
                  *_run(["pkg-config", "--cflags", *packages]).split()]
        units = [(source, cflags) for source in [SOURCE, *sorted(out.rglob("*.cc"))]]
        try:  # the generated stubs are most of a ~40 s build: compiled side by side
            objects = compile_objects(cxx, units, out)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"native floor: {Path(cxx).name} failed: "
                               f"{(exc.stderr or exc.stdout).strip()[-2000:]} ({NEEDS})") from None
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"native floor: {Path(cxx).name}: {exc}") from None
        built = out / "router_floor"
        _run([cxx, *map(str, objects), "-o", str(built),
              *_run(["pkg-config", "--libs", *packages]).split()])
        os.chmod(built, 0o755)
        os.replace(built, target)  # atomic: a concurrent build of the same target is harmless
    return target


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"native floor: {Path(argv[0]).name} failed: "
                           f"{(exc.stderr or exc.stdout).strip()[-2000:]} ({NEEDS})") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"native floor: {Path(argv[0]).name}: {exc}") from None
    return done.stdout


def built_or_said() -> bool:
    """Build the floor now (so its build is not timed in a bench); False: it cannot be built
    here, and why was printed."""
    try:
        if not (kernels_dir() / binary_name()).is_file():
            print("building the native floor router (once, about a minute) ...", flush=True)
        binary()
    except (RuntimeError, OSError) as exc:
        print(f"{exc}: the native floor is left out", flush=True)
        return False
    return True
