"""pip install of flashrt_ros: the Python packages, the ament index layout, and the generated interfaces.

`pip install --no-build-isolation .` generates and compiles msg/ and srv/ with the rosidl found in the
environment (the ROS 2 wheels, or a sourced ROS distribution) through CMakeLists.txt, then installs the
generated Python modules inside the `flashrt_ros` package and the typesupport libraries under
`<prefix>/lib`, so `from flashrt_ros.msg import ActionChunk` works beside the nodes. On a robot with a
ROS 2 install, `colcon build` uses CMakeLists.txt directly instead of this file.
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PKG = "flashrt_ros"
STAGE = HERE / "build" / "interfaces"
INTERFACE_SOURCES = ["CMakeLists.txt", "package.xml", "cmake", "msg", "srv"]
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"


def _sources_digest() -> str:
    h = hashlib.sha256(sys.prefix.encode())
    for name in INTERFACE_SOURCES:
        for path in sorted((HERE / name).rglob("*")) if (HERE / name).is_dir() else [HERE / name]:
            if path.is_file():
                h.update(str(path.relative_to(HERE)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def build_interfaces() -> Path:
    """Run rosidl through CMake into build/interfaces/install (cached by a digest of the sources)."""
    install = STAGE / "install"
    stamp = STAGE / "digest"
    digest = _sources_digest()
    if stamp.is_file() and stamp.read_text() == digest and install.is_dir():
        return install
    shutil.rmtree(STAGE, ignore_errors=True)
    # A copy of the sources: CMake refuses exported include dirs inside the source tree, and the
    # virtual environment usually lives there.
    src = STAGE / "src"
    src.mkdir(parents=True)
    for name in INTERFACE_SOURCES:
        (shutil.copytree if (HERE / name).is_dir() else shutil.copy)(HERE / name, src / name)
    work = STAGE / "cmake-build"
    work.mkdir()
    env = dict(os.environ)
    prefixes = [sys.prefix] + [p for p in env.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p]
    env["AMENT_PREFIX_PATH"] = os.pathsep.join(dict.fromkeys(prefixes))
    cmake = shutil.which("cmake", path=os.path.join(sys.prefix, "bin") + os.pathsep + env.get("PATH", ""))
    if cmake is None:
        raise RuntimeError("cmake not found: install it (pip install cmake) to build the ROS interfaces")
    configure = [
        cmake, str(src), "-DFLASHRT_INTERFACES_ONLY=ON", "-DBUILD_TESTING=OFF",
        f"-DCMAKE_PREFIX_PATH={env['AMENT_PREFIX_PATH'].replace(os.pathsep, ';')}",
        f"-DPython3_EXECUTABLE={sys.executable}", f"-DCMAKE_INSTALL_PREFIX={install}",
    ]
    jobs = str(max(1, os.cpu_count() or 1))
    for cmd in (configure, [cmake, "--build", ".", "-j", jobs], [cmake, "--install", "."]):
        result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.stderr.write(result.stdout[-6000:] + result.stderr[-6000:])
            raise RuntimeError(f"building the ROS interfaces failed at: {' '.join(cmd[:3])}")
    stamp.write_text(digest)
    return install


def generated_python_dir(install: Path) -> Path:
    return install / "lib" / PYVER / "site-packages" / PKG


class BuildPyWithInterfaces(build_py):
    """build_py that also copies the generated msg/srv modules into the flashrt_ros package."""

    def run(self):
        super().run()
        gen = generated_python_dir(build_interfaces())
        target = Path(self.build_lib) / PKG
        for item in gen.iterdir():
            if item.name in ("__init__.py", "__pycache__") or item.suffix == ".c":
                continue
            dest = target / item.name
            if item.is_dir():
                shutil.copytree(item, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(item, dest)


def node_executable() -> str:
    """scripts/policy_node with this interpreter in its #! line (build/node/policy_node): launch_ros runs
    lib/flashrt_ros/policy_node directly, and `/usr/bin/env python3` would find whichever Python is first on PATH
    (the system's, without this environment's packages, when the environment is not activated). colcon's CMake
    install keeps the script as it is: there the sourced workspace provides the packages."""
    source = (HERE / "scripts" / "policy_node").read_text()
    body = source.split("\n", 1)[1] if source.startswith("#!") else source
    out = HERE / "build" / "node" / "policy_node"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"#!{sys.executable}\n{body}")
    out.chmod(0o755)
    return str(out.relative_to(HERE))


def data_files():
    """The ament layout launch_ros expects, plus the typesupport libraries and interface definitions."""
    files = [
        (f"share/{PKG}", ["package.xml"]),
        (f"share/{PKG}/launch", sorted(glob.glob("launch/*.py"))),
        (f"share/{PKG}/config", sorted(glob.glob("config/*.yaml"))),
        (f"lib/{PKG}", [node_executable()]),
    ]
    if not any(cmd in sys.argv for cmd in ("bdist_wheel", "build", "build_py", "install", "develop")):
        return files  # metadata-only invocations (egg_info, dist_info) need no build
    install = build_interfaces()
    for path in sorted(install.rglob("*")):
        rel = path.relative_to(install)
        if not path.is_file() or rel.parts[:2] == ("lib", PYVER) or rel.name == "package.xml":
            continue
        files.append((str(rel.parent), [str(path.relative_to(HERE))]))
    return files


setup(
    name="flashrt_ros",
    version="0.1.0",
    description="Low-latency robot policy inference (pi0.5) as a ROS 2 package",
    packages=find_packages(include=["flashrt_core", "flashrt_core.*", "flashrt_bench", "flashrt_ros", "flashrt_ros.*"]),
    package_data={"flashrt_core": ["data/*"]},
    data_files=data_files(),
    cmdclass={"build_py": BuildPyWithInterfaces},
    python_requires=">=3.10",
    entry_points={"console_scripts": [
        "flashrt = flashrt_ros.cli:main",
        "policy_node = flashrt_ros.policy_node:main",
    ]},
)
