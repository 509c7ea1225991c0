"""The installed package has the ament index layout launch_ros expects, and the launch files are sound."""
import ast
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PREFIX = pathlib.Path(sys.prefix)


def test_ament_index_layout_is_installed():
    assert (PREFIX / "share/ament_index/resource_index/packages/flashrt_ros").is_file()
    share = PREFIX / "share/flashrt_ros"
    assert (share / "package.xml").read_text() == (REPO / "package.xml").read_text()
    for name in ("policy.launch.py", "replay.launch.py"):
        assert (share / "launch" / name).is_file(), name
    for name in ("pi05_tiny.yaml", "pi05.yaml", "policy_node.yaml"):
        assert (share / "config" / name).is_file(), name
    node = PREFIX / "lib/flashrt_ros/policy_node"
    assert node.is_file() and os.access(node, os.X_OK)
    assert "flashrt_ros.policy_node" in node.read_text()
    # launch_ros runs it directly: with this environment's Python, activated or not (not `env python3`)
    shebang = node.read_text().splitlines()[0]
    assert shebang.startswith("#!/") and pathlib.Path(shebang[2:]).parent == PREFIX / "bin", shebang
    assert (PREFIX / "share/ament_index/resource_index/rosidl_interfaces/flashrt_ros").is_file()


def test_package_xml_names_the_package_and_interface_group():
    text = (REPO / "package.xml").read_text()
    assert "<name>flashrt_ros</name>" in text and "rosidl_interface_packages" in text


@pytest.mark.parametrize("name", ["policy.launch.py", "replay.launch.py"])
def test_launch_files_declare_described_arguments(name):
    tree = ast.parse((REPO / "launch" / name).read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "generate_launch_description" in functions
    declared = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "DeclareLaunchArgument"]
    assert declared, "no launch arguments"
    for call in declared:
        assert any(k.arg == "description" for k in call.keywords), ast.unparse(call)


def test_policy_node_entry_point_imports():
    import runpy

    module = runpy.run_path(str(PREFIX / "lib/flashrt_ros/policy_node"), run_name="not_main")
    assert callable(module["main"])


def test_package_xml_is_well_formed_xml():
    """ament parses package.xml at every install: a malformed one (say, '--' inside a comment) fails `make install`
    with a parser error far from its cause."""
    import xml.dom.minidom

    xml.dom.minidom.parse(str(REPO / "package.xml"))
