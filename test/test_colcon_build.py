"""The full CMake build (what `colcon build` runs on a ROS 2 install) configures, builds and installs.

FLASHRT_INTERFACES_ONLY=OFF is the colcon path: CMakeLists.txt installs the interfaces, both Python packages,
the `flashrt` command, the node executable, launch files and config in the ament layout. It runs here with the
ROS build tools of the pinned wheels in this interpreter's prefix (as setup.py does), into a temporary build
folder and install prefix, and the installed tree is then used from a subprocess the way a sourced workspace
would be (its python dir on PYTHONPATH, its lib/ on LD_LIBRARY_PATH).
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = "flashrt_ros"
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
# What CMakeLists.txt reads. A copy, as in setup.py: the venv usually lives in the checkout, and CMake refuses
# exported include directories inside the source tree.
SOURCES = ["CMakeLists.txt", "package.xml", "cmake", "msg", "srv", "flashrt_core", "flashrt_bench", "flashrt_ros",
           "launch", "config", "scripts"]
MESSAGES = sorted(p.stem for p in (REPO / "msg").glob("*.msg"))
SERVICES = sorted(p.stem for p in (REPO / "srv").glob("*.srv"))


def _run(cmd, cwd, env, what, timeout=900):
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{what} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return result


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    """Configure + build + install the package with FLASHRT_INTERFACES_ONLY=OFF; the install prefix."""
    root = tmp_path_factory.mktemp("colcon_build")
    src, work, install = root / "src" / PKG, root / "build", root / "install"
    src.mkdir(parents=True)
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, src / name)
    work.mkdir()
    env = dict(os.environ)
    prefixes = [sys.prefix] + [p for p in env.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p]
    env["AMENT_PREFIX_PATH"] = os.pathsep.join(dict.fromkeys(prefixes))
    cmake = shutil.which("cmake", path=os.path.join(sys.prefix, "bin") + os.pathsep + env.get("PATH", ""))
    assert cmake, "cmake not found (requirements.txt pins it)"
    _run([cmake, str(src), "-DFLASHRT_INTERFACES_ONLY=OFF", "-DBUILD_TESTING=OFF",
          f"-DCMAKE_PREFIX_PATH={env['AMENT_PREFIX_PATH'].replace(os.pathsep, ';')}",
          f"-DPython3_EXECUTABLE={sys.executable}", f"-DCMAKE_INSTALL_PREFIX={install}"], work, env, "configure")
    _run([cmake, "--build", ".", "-j", str(max(1, os.cpu_count() or 1))], work, env, "build")
    _run([cmake, "--install", "."], work, env, "install")
    # A second install (colcon build run again) must leave the same tree: the generated interfaces and the
    # package's own modules share one directory, and rosidl installs an empty __init__.py there first.
    _run([cmake, "--install", "."], work, env, "second install")
    return install


@pytest.fixture(scope="module")
def source(prefix) -> pathlib.Path:
    """The copy of the sources that was built (the checkout may change meanwhile)."""
    return prefix.parent / "src" / PKG


def _python_dir(prefix: pathlib.Path) -> pathlib.Path:
    return prefix / "lib" / PYVER / "site-packages"


def _workspace_env(prefix: pathlib.Path) -> dict:
    """This process's environment with the install prefix in front, as `. install/setup.bash` would give."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_python_dir(prefix)), env.get("PYTHONPATH")) if p)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(prefix / "lib"), env.get("LD_LIBRARY_PATH")) if p)
    env["AMENT_PREFIX_PATH"] = os.pathsep.join(p for p in (str(prefix), env.get("AMENT_PREFIX_PATH")) if p)
    env["PATH"] = os.pathsep.join(p for p in (str(prefix / "bin"), env.get("PATH")) if p)
    return env


_IMPORT_CHECK = """
import importlib, json, sys
import flashrt_ros, flashrt_ros.cli, flashrt_ros.msg, flashrt_ros.srv, flashrt_core
from rclpy.serialization import deserialize_message, serialize_message
msgs, srvs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
round_trips = {}
for name in msgs:
    cls = getattr(flashrt_ros.msg, name)
    round_trips[name] = deserialize_message(serialize_message(cls()), cls) == cls()
for name in srvs:
    cls = getattr(flashrt_ros.srv, name)
    for part in (cls.Request, cls.Response):
        round_trips[name + "." + part.__name__] = deserialize_message(serialize_message(part()), part) == part()
from flashrt_ros.msg import ActionChunk
chunk = ActionChunk(horizon=2, action_dim=1, actions=[0.5, -1.5], joint_names=["j0"], decision_id=7)
back = deserialize_message(serialize_message(chunk), ActionChunk)
files = {m: sys.modules[m].__file__ for m in ("flashrt_ros", "flashrt_ros.cli", "flashrt_ros.msg",
                                             "flashrt_ros.srv", "flashrt_core")}
libs = sorted({line.split()[-1] for line in open("/proc/self/maps")
               if "flashrt_ros" in line.rsplit("/", 1)[-1] and ".so" in line})
print(json.dumps({"files": files, "libs": libs, "round_trips": round_trips,
                  "chunk": [back.horizon, list(back.actions), list(back.joint_names), back.decision_id]}))
"""


def test_installed_interfaces_import_from_the_prefix(prefix):
    result = _run([sys.executable, "-c", _IMPORT_CHECK, json.dumps(MESSAGES), json.dumps(SERVICES)],
                  prefix, _workspace_env(prefix), "importing the installed interfaces", timeout=120)
    got = json.loads(result.stdout.strip().splitlines()[-1])
    pydir = str(_python_dir(prefix)) + os.sep
    for module, path in got["files"].items():
        assert path.startswith(pydir), (module, path)  # not the copy pip installed into this environment
    # the typesupport libraries and the Python extensions that were loaded are the prefix's own
    assert any(lib.startswith(pydir) for lib in got["libs"]), got["libs"]
    assert any(lib.startswith(str(prefix / "lib") + os.sep + "lib") for lib in got["libs"]), got["libs"]
    assert all(lib.startswith(str(prefix) + os.sep) for lib in got["libs"]), got["libs"]
    assert set(got["round_trips"]) >= set(MESSAGES) and all(got["round_trips"].values()), got["round_trips"]
    assert {"ActionChunk", "CapsuleInfo"} <= set(MESSAGES) and len(SERVICES) >= 5
    assert len(got["round_trips"]) == len(MESSAGES) + 2 * len(SERVICES)
    assert got["chunk"] == [2, [0.5, -1.5], ["j0"], 7]


def test_generated_modules_and_package_share_one_directory(prefix, source):
    pkg = _python_dir(prefix) / PKG
    # the package's own __init__.py replaced the empty one rosidl generates, even after a second install
    assert (pkg / "__init__.py").read_text() == (source / PKG / "__init__.py").read_text()
    assert "extend_path" in (pkg / "__init__.py").read_text()
    for path in (source / PKG).rglob("*.py"):
        rel = path.relative_to(source / PKG)
        assert (pkg / rel).read_text() == path.read_text(), rel
    assert (pkg / "msg" / "_action_chunk.py").is_file() and (pkg / "srv" / "_snapshot_capsule.py").is_file()
    assert list(pkg.glob("flashrt_ros_s__rosidl_typesupport_*.so")), "generated Python extensions missing"
    core = _python_dir(prefix) / "flashrt_core"
    files = [p for p in (source / "flashrt_core").rglob("*") if p.is_file()]
    assert len(files) > 10
    for path in files:  # every module and any package data
        assert (core / path.relative_to(source / "flashrt_core")).read_bytes() == path.read_bytes(), path


def test_ament_layout_is_installed(prefix, source):
    share = prefix / "share" / PKG
    index = prefix / "share" / "ament_index" / "resource_index"
    assert (index / "packages" / PKG).is_file()
    assert (index / "rosidl_interfaces" / PKG).is_file()
    assert (share / "package.xml").read_text() == (source / "package.xml").read_text()
    for folder in ("launch", "config"):
        names = sorted(p.name for p in (source / folder).iterdir() if p.is_file())
        assert names, folder
        for name in names:
            assert (share / folder / name).read_bytes() == (source / folder / name).read_bytes(), name
    assert (share / "launch" / "policy.launch.py").is_file() and (share / "config" / "pi05.yaml").is_file()
    node = prefix / "lib" / PKG / "policy_node"
    assert node.is_file() and os.access(node, os.X_OK)
    assert node.read_text() == (source / "scripts" / "policy_node").read_text()
    assert (share / "msg" / "ActionChunk.msg").is_file() and (share / "srv" / "SnapshotCapsule.srv").is_file()


def test_installed_flashrt_command_runs(prefix):
    command = prefix / "bin" / "flashrt"
    assert command.is_file() and os.access(command, os.X_OK)
    # what a symlink install (colcon build --symlink-install) links bin/flashrt to is executable too
    assert os.access(prefix.parent / "build" / "bin" / "flashrt", os.X_OK)
    env = _workspace_env(prefix)
    result = _run([str(command), "--help"], prefix, env, "flashrt --help", timeout=120)
    assert result.stdout.startswith("usage: flashrt")
    from flashrt_ros.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.choices and a.dest == "command").choices
    for name in commands:
        assert name in result.stdout, name
    # found on PATH like any installed command, and it does real work with the installed package data
    assert shutil.which("flashrt", path=env["PATH"]) == str(command)
    contract = prefix / "share" / PKG / "config" / "pi05_tiny.yaml"
    check = _run(["flashrt", "contract", "check", str(contract)], prefix, env, "flashrt contract check")
    assert check.stdout.startswith(f"{contract}: OK"), check.stdout
